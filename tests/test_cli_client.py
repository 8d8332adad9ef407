"""The operator's commands against a real daemon: `hal0d status [--watch]`, `load`, `unload`,
`requests`, each run as the real `python -m hal0d` process against a real `hal0d serve` (its
on-demand slot's command the real stub), finding it from the config file or from --url and
HAL0D_API_KEY; and the one-line failures when the daemon is not there or refuses the key."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web

from hal0d_stub.prompt import prompt_tokens
from tests.harness.cli import CLI_DEADLINE_S, QUIT_S, ROOT, cli, cli_daemon, env_without, row_of
from tests.harness.config import CLI_KEY, daemon_toml
from tests.harness.daemons import Hal0dProcess, spawn, stop
from tests.harness.poll import eventually
from tests.harness.ports import free_port


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Hal0dProcess]:
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(daemon_toml(tmp_path, port))
    async with cli_daemon(config, port) as served:
        yield served


async def test_status_load_requests_and_unload_through_the_config_file(
    daemon: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    config = str(daemon.config)
    code, out, err = await cli("status", "--config", config)
    assert code == 0, err
    assert out.splitlines()[0].split() == [
        "SLOT", "STATE", "MODELS", "IN_FLIGHT", "QUEUED", "LOADED/IDLE", "MEMORY_MIB", "TOK/S",
        "TTFT_P50_MS"]
    assert row_of(out, "a") == ["a", "stopped", "chat", "0", "0", "-", "512", "-", "-"]

    code, out, err = await cli("load", "a", "--config", config)
    assert code == 0, err
    assert out.startswith("a: ready (waited ")

    async with http.post(f"{daemon.url}/v1/chat/completions",
                         headers={"Authorization": f"Bearer {CLI_KEY}"},
                         json={"model": "chat", "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status == 200
        await resp.read()
        request_id = resp.headers["X-Request-Id"]

    async def served_once() -> list[str]:
        code, out, err = await cli("status", "--config", config)
        assert code == 0, err
        row = row_of(out, "a")
        assert row[1] == "ready" and row[5] == "idle" and row[8] != "-", out
        return row

    row = await eventually(served_once, CLI_DEADLINE_S, "the request in the slot's metrics")
    assert row[7] != "-"  # tok/s

    code, out, err = await cli("requests", "-n", "5", "--config", config)
    assert code == 0, err
    assert request_id in out and "chat" in out.splitlines()[1]
    # The stream carried no usage: its prompt count is what the timings on its last chunk say
    # (cache_n + prompt_n, as llama-server's), and "-" where an upstream sends neither, never 0.
    [line] = [line for line in out.splitlines() if request_id in line]
    said = prompt_tokens({"messages": [{"role": "user", "content": "hi"}]})
    assert line.split()[-1].startswith(f"{said}/"), line

    code, out, err = await cli("unload", "a", "--config", config)
    assert (code, out.strip()) == (0, "a: stopped"), err


async def test_status_watch_redraws_as_events_arrive_and_ends_0_on_ctrl_c(
    daemon: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    env = {**env_without("HAL0D_API_KEY"), "HAL0D_API_KEY": CLI_KEY}
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "status", "--watch", "--url", daemon.url, cwd=ROOT,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = watcher.stdout, watcher.stderr
    assert stdout is not None and stderr is not None
    seen = bytearray()

    async def shown(text: str) -> bool:
        with contextlib.suppress(TimeoutError):
            seen.extend(await asyncio.wait_for(stdout.read(65536), 0.2))
        screens = seen.decode(errors="replace").split("\x1b[H\x1b[2J")
        return text in screens[-1]

    try:
        await eventually(lambda: shown(" stopped "), CLI_DEADLINE_S, "the first screen")
        async with http.post(f"{daemon.url}/api/slots/a/load?wait=false",
                             headers={"Authorization": f"Bearer {CLI_KEY}"}) as resp:
            assert resp.status == 202
        await eventually(lambda: shown("a: starting -> ready"), CLI_DEADLINE_S, "redrawn as ready")
        assert " ready " in seen.decode().split("\x1b[H\x1b[2J")[-1]
        watcher.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(watcher.wait(), QUIT_S)
        assert code == 0, (await stderr.read()).decode()
    finally:
        if watcher.returncode is None:
            watcher.kill()
            await watcher.wait()


async def test_status_watch_reconnects_when_hal0d_restarts(daemon: Hal0dProcess) -> None:
    env = {**env_without("HAL0D_API_KEY"), "HAL0D_API_KEY": CLI_KEY}
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "status", "--watch", "--url", daemon.url, cwd=ROOT,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout = watcher.stdout
    assert stdout is not None
    seen = bytearray()

    async def shown(text: str) -> bool:
        with contextlib.suppress(TimeoutError):
            seen.extend(await asyncio.wait_for(stdout.read(65536), 0.2))
        return text in seen.decode(errors="replace")

    again: asyncio.subprocess.Process | None = None
    try:
        await eventually(lambda: shown(" stopped "), CLI_DEADLINE_S, "the first screen")
        daemon.process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(daemon.process.wait(), CLI_DEADLINE_S)
        await eventually(lambda: shown("Connection to hal0d lost: reconnecting"), CLI_DEADLINE_S,
                         "the page's notice")
        assert watcher.returncode is None  # still watching, not exited 1
        before = len(seen)
        again = (await spawn(daemon.config, daemon.port, daemon.log, append=True,
                             env=env_without("HAL0D_API_KEY"))).process

        async def redrawn() -> bool:
            await shown("")
            return " stopped " in seen[before:].decode(errors="replace")

        await eventually(redrawn, CLI_DEADLINE_S, "a fresh screen from the restarted hal0d")
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watcher.wait(), CLI_DEADLINE_S) == 0
    finally:
        for process in (watcher, again):
            if process is not None:
                await stop(process)


async def test_a_daemon_that_is_not_running_is_one_line_and_exit_1() -> None:
    port = free_port()
    for command in (("status",), ("status", "--watch"), ("load", "a"), ("requests",)):
        code, out, err = await cli(*command, "--url", f"http://127.0.0.1:{port}")
        assert code == 1 and out == ""
        assert err == (f"hal0d {command[0]}: hal0d is not running at http://127.0.0.1:{port} "
                       "(connection refused)\n")


async def test_a_refused_key_and_a_missing_key_are_one_line_and_exit_1(
        daemon: Hal0dProcess) -> None:
    code, _, err = await cli("status", "--url", daemon.url, key="sk-wrong")
    assert code == 1
    assert err == f"hal0d status: hal0d at {daemon.url} refused the API key: the API key is " \
                  "not valid\n"
    code, _, err = await cli("status", "--url", daemon.url)
    assert code == 1 and err.count("\n") == 1
    assert "needs an API key: set HAL0D_API_KEY" in err
    # The right key in the environment works with --url.
    code, out, err = await cli("status", "--url", daemon.url, key=CLI_KEY)
    assert code == 0 and row_of(out, "a")[1] == "stopped", err


async def test_a_slot_the_daemon_does_not_know_is_its_own_message(daemon: Hal0dProcess) -> None:
    code, _, err = await cli("load", "nope", "--config", str(daemon.config))
    assert code == 1
    assert err == "hal0d load: no slot named 'nope' (HTTP 404)\n"


async def test_a_config_that_cannot_be_read_is_one_line_and_exit_1(tmp_path: Path) -> None:
    code, _, err = await cli("status", "--config", str(tmp_path / "missing.toml"))
    assert code == 1 and err.count("\n") == 1
    assert err.startswith(f"hal0d status: cannot use {tmp_path / 'missing.toml'}: ")


@pytest.fixture
async def slow_daemon(tmp_path: Path) -> AsyncIterator[Hal0dProcess]:
    """A daemon whose on-demand slot `a` takes 30 s to load (its stub waits before listening)
    and whose slot `b` cannot start (a missing program)."""
    port = free_port()
    config = tmp_path / "hal0d.toml"
    text = daemon_toml(tmp_path, port).replace('"--delay", "0.005"]',
                                               '"--delay", "0.005", "--startup-delay", "30"]')
    assert "--startup-delay" in text
    config.write_text(text + textwrap.dedent(f"""
        [[slots]]
        name = "b"
        upstream = "http://127.0.0.1:{free_port()}"
        models = ["tool"]
        command = ["hal0d-no-such-program-b"]
    """))
    async with cli_daemon(config, port) as served:
        yield served


async def test_status_without_watch_shows_a_loads_phase_and_why_a_slot_is_in_error(
    slow_daemon: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    config = str(slow_daemon.config)
    async with http.post(f"{slow_daemon.url}/api/slots/a/load?wait=false",
                         headers={"Authorization": f"Bearer {CLI_KEY}"}) as resp:
        assert resp.status == 202

    async def phases() -> list[str]:
        code, out, err = await cli("status", "--config", config)
        assert code == 0, err
        row = row_of(out, "a")
        assert row[1] == "starting" and row[2] == "(probing", out
        assert "b: cannot start 'hal0d-no-such-program-b'" in out, out
        return row

    row = await eventually(phases, CLI_DEADLINE_S, "the load's phase and b's reason")
    first = int(row[3].rstrip("s)"))
    # The phase's age counts from the load's start, not from the last event.
    later = await eventually(
        lambda: _later_phase(config, first), CLI_DEADLINE_S, "the probing phase's age grown")
    assert later > first


async def _later_phase(config: str, first: int) -> int:
    code, out, err = await cli("status", "--config", config)
    assert code == 0, err
    seconds = int(row_of(out, "a")[3].rstrip("s)"))
    return seconds if seconds >= first + 2 else 0


async def test_status_watch_counts_idle_up_between_events(
    daemon: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    """Nothing happens after the load: the screen is still redrawn, idle counting up from the
    slot's idle-since time (not standing at the age it had at the last event)."""
    import re

    code, _, err = await cli("load", "a", "--config", str(daemon.config))
    assert code == 0, err
    env = {**env_without("HAL0D_API_KEY"), "HAL0D_API_KEY": CLI_KEY}
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "status", "--watch", "--url", daemon.url, cwd=ROOT,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout = watcher.stdout
    assert stdout is not None
    seen = bytearray()

    async def idles() -> list[int]:
        with contextlib.suppress(TimeoutError):
            seen.extend(await asyncio.wait_for(stdout.read(65536), 0.2))
        values = [int(v) for v in re.findall(r"idle (\d+)s", seen.decode(errors="replace"))]
        return values if values and values[-1] >= values[0] + 3 else []

    try:
        values = await eventually(idles, CLI_DEADLINE_S,
                                  "idle counting up on one screen after another")
        assert values == sorted(values), values
    finally:
        watcher.kill()
        await watcher.wait()


@pytest.mark.parametrize("ending", [b"\r", b"\r\n"], ids=["CR", "CRLF"])
async def test_status_watch_reads_a_feed_whose_lines_end_in_cr_or_crlf(
    upstream_app: Any, ending: bytes
) -> None:
    """--watch reads the feed as the relay reads an upstream: lines end at CR, LF or CRLF. A
    daemon (here the two admin paths --watch asks, nothing else) whose feed ends its lines in CR
    alone, or CRLF, in one read with a heartbeat between the events, is drawn as hal0d's is."""
    view = {"name": "a", "state": "starting", "models": ["chat"], "in_flight": 0, "queued": 0}
    frames = [
        b"event: hello\ndata: " + orjson.dumps({"slots": [view]}) + b"\n\n",
        b": heartbeat\n\n",
        b"event: slot\ndata: " + orjson.dumps({"slot": "a", "old": "starting", "new": "ready",
                                               "view": {**view, "state": "ready"}}) + b"\n\n",
    ]

    async def feed(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(b"".join(frames).replace(b"\n", ending))
        await asyncio.Event().wait()  # open until the watcher leaves
        return response

    async def no_metrics(request: web.Request) -> web.Response:
        return web.json_response({"slots": []})

    url = await upstream_app({"GET /api/events": feed, "GET /api/slots/metrics": no_metrics})
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "status", "--watch", "--url", url, cwd=ROOT,
        env=env_without("HAL0D_API_KEY"), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stdout = watcher.stdout
    assert stdout is not None
    seen = bytearray()

    async def last_screen() -> str:
        with contextlib.suppress(TimeoutError):
            seen.extend(await asyncio.wait_for(stdout.read(65536), 0.2))
        screen = seen.decode(errors="replace").split("\x1b[H\x1b[2J")[-1]
        return screen if "last: a: starting -> ready" in screen else ""

    try:
        screen = await eventually(last_screen, CLI_DEADLINE_S, "both events drawn")
        assert row_of(screen, "a")[:3] == ["a", "ready", "chat"], screen
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watcher.wait(), QUIT_S) == 0
    finally:
        await stop(watcher)
