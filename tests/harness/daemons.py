"""The daemons a test runs, under names that say which: an in-process hal0d is a TestServer in the
test's own event loop (`start_hal0d`, `start`); a `Hal0dProcess` is a real `hal0d serve` started
with asyncio (`spawn`, `launch`, `serving`) and steered with signals; a `Hal0dPopen` is one
started with subprocess.Popen for a test without an event loop (the browser's). A process's
output (JSON lines) goes to a file the test reads its events from, and the watch for lines only
a bug writes reads it too (logs.watch_log)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import textwrap
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp.test_utils import TestServer
from yarl import URL

from hal0d.config import Config
from tests.harness.config import config_text
from tests.harness.logs import watch_log
from tests.harness.poll import eventually, eventually_sync
from tests.harness.ports import free_port

STARTUP_S = 15.0  # a Python process importing aiohttp, on a busy two-core box
STOP_WITHIN_S = 15.0  # a grace of up to 1.5 s, then slot processes get STOP_GRACE_S at most
EXIT_SLACK_S = 3.0  # how much longer than its grace a stopping hal0d may take to exit
HAL0D = (sys.executable, "-m", "hal0d")

# -- in process ------------------------------------------------------------------------------

# start_hal0d's: an upstream and make_config's keywords (or `config=`) in, the server out.
ServerFactory = Callable[..., Awaitable[TestServer]]
# start_ollama's: the same in, the server and its Ollama listener's base URL out.
OllamaFactory = Callable[..., Awaitable[tuple[TestServer, str]]]


async def start(start_hal0d: ServerFactory, config: Config) -> TestServer:
    """An in-process hal0d on `config` alone (its slots name their own upstreams)."""
    return await start_hal0d("http://unused", config=config)


# -- as a process, with asyncio ----------------------------------------------------------------


@dataclass
class Hal0dProcess:
    """One `hal0d serve` process, its config file and its log (JSON lines)."""

    process: asyncio.subprocess.Process
    port: int
    config: Path
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def make_url(self, path: str) -> URL:
        """As a TestServer's: the helpers that ask a daemon take either."""
        return URL(self.url + path)

    def events(self) -> list[dict[str, Any]]:
        events = []
        for line in self.log.read_text().splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                events.append(orjson.loads(line))
        return events

    def named(self, name: str) -> list[dict[str, Any]]:
        return [event for event in self.events() if event.get("event") == name]

    async def wait_for_event(self, name: str, timeout: float = 5.0) -> dict[str, Any]:
        def logged() -> dict[str, Any]:
            found = self.named(name)
            assert found, f"no {name} in hal0d's log:\n{self.log.read_text()}"
            return found[-1]

        return await eventually(logged, timeout, f"{name} in hal0d's log")

    async def wait_for_count(self, name: str, count: int, timeout: float = 5.0) -> None:
        await eventually(lambda: len(self.named(name)) >= count, timeout,
                         f"{count} {name} lines in hal0d's log")

    def send(self, signum: signal.Signals) -> None:
        self.process.send_signal(signum)


Hal0dProcessFactory = Callable[..., Awaitable[Hal0dProcess]]


async def spawn(config: Path, port: int, log: Path, *flags: str, append: bool = False,
                **options: Any) -> Hal0dProcess:
    """`hal0d serve --config config` started, not waited for; its output into `log` (after
    what is there, with `append`). `options` go to create_subprocess_exec (`env`, ...)."""
    watch_log(log)
    with log.open("ab" if append else "wb") as out:
        process = await asyncio.create_subprocess_exec(
            *HAL0D, "serve", "--config", str(config), *flags,
            stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=asyncio.subprocess.STDOUT,
            **options,
        )
    return Hal0dProcess(process, port, config, log)


async def launch(tmp_path: Path, upstream: str, **options: Any) -> Hal0dProcess:
    """A real `hal0d serve` on a free port, from config_text(upstream, ...), once it serves."""
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(config_text(upstream, port, tmp_path, **options))
    hal0d = await spawn(config, port, tmp_path / "hal0d.log")
    await hal0d.wait_for_event("server.started", timeout=10)
    return hal0d


async def stop(process: asyncio.subprocess.Process) -> None:
    """SIGTERM, so hal0d stops its slot processes itself; SIGKILL only if it will not end."""
    if process.returncode is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        async with asyncio.timeout(STOP_WITHIN_S):
            await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()


@contextlib.asynccontextmanager
async def serving(config: Path, port: int, *, within: float = STARTUP_S,
                  **options: Any) -> AsyncIterator[Hal0dProcess]:
    """`hal0d serve --config config` (its log hal0d.log beside it) once it serves, until the
    block ends; `options` go to spawn."""
    served = await spawn(config, port, config.parent / "hal0d.log", **options)
    try:
        await served.wait_for_event("server.started", within)
        yield served
    finally:
        await stop(served.process)


async def reload(hal0d: Hal0dProcess, slots: str) -> dict[str, Any]:
    """Rewrites the config's slots and sends SIGHUP; the config.reloaded line it caused."""
    seen = len(hal0d.named("config.reloaded"))
    text = hal0d.config.read_text()
    begin, end = text.index("[[slots]]"), text.index("[metrics]")
    hal0d.config.write_text(text[:begin] + textwrap.dedent(slots) + "\n" + text[end:])
    hal0d.send(signal.SIGHUP)
    await hal0d.wait_for_count("config.reloaded", seen + 1)
    return hal0d.named("config.reloaded")[-1]


# -- as a process, without an event loop -------------------------------------------------------


def popen(config: Path, output: Path, *, program: Sequence[str] = HAL0D,
          **options: Any) -> subprocess.Popen[bytes]:
    """`program serve --config config` started, its output after what `output` holds;
    `options` go to subprocess.Popen (`cwd`, ...)."""
    watch_log(output)
    with output.open("ab") as out:
        return subprocess.Popen([*program, "serve", "--config", str(config)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                **options)


@dataclass
class Hal0dPopen:
    """One `hal0d serve` process for a test without an event loop, asked with urllib."""

    port: int
    config: Path
    output: Path
    process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = popen(self.config, self.output)
        eventually_sync(self.ready, 20, "hal0d serves")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/healthz", timeout=1):
                return True
        except OSError:
            assert self.process is not None and self.process.poll() is None, self.tail()
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=15)

    def tail(self) -> str:
        return self.output.read_text()[-3000:] if self.output.exists() else ""

    def call(self, path: str, body: dict[str, Any] | None = None, *,
             key: str | None = None) -> bytes:
        """POST `body` (GET without one) to `path`, with `key` as its bearer token."""
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.read()
