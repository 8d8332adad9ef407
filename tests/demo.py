"""The demo `make run` serves, run for real: `hal0d serve` on a copy of etc/hal0d.toml with only
its port and the stub's log path rewritten, so a test can run beside `make run` and beside
itself while everything else, the stub command and its free port included, is the demo
configuration."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tests.harness.daemons import popen
from tests.harness.ports import free_port

REPO = Path(__file__).resolve().parents[1]
READY_WITHIN_S = 20.0
DEMO_PORT = 8080
DEMO_STUB_LOG = "/tmp/stub-reasoning.log"
DEMO_OLLAMA = 'listen = "127.0.0.1:11435"'


@dataclass
class RunningDemo:
    port: int
    config: Path
    stub_log: Path
    output: Path
    process: subprocess.Popen[bytes]

    def as_typed_for_make_run(self, text: str) -> str:
        """A command written for `make run` (port 8080, the demo stub's log), pointed at this
        daemon and its stub log."""
        return text.replace(f"localhost:{DEMO_PORT}", f"localhost:{self.port}").replace(
            DEMO_STUB_LOG, str(self.stub_log)
        )

    def stub_lines(self) -> list[str]:
        return self.stub_log.read_text().splitlines() if self.stub_log.exists() else []

    def diagnostics(self) -> str:
        log = self.output.read_text()[-3000:] if self.output.exists() else ""
        return f"hal0d output:\n{log}\nstub log:\n" + "\n".join(self.stub_lines()[-20:])


def rewrite_demo_config(port: int, stub_log: Path, stub_port: int | None = None) -> str:
    """The demo's config on `port`; its stub keeps the free port hal0d picks, unless a test
    pins it to `stub_port`."""
    text = (REPO / "etc" / "hal0d.toml").read_text()
    replacements = [
        (f"port = {DEMO_PORT}", f"port = {port}"),
        (json.dumps(DEMO_STUB_LOG), json.dumps(str(stub_log))),
    ]
    if stub_port is not None:
        replacements += [
            ('upstream = "http://127.0.0.1:{free_port}"',
             f'upstream = "http://127.0.0.1:{stub_port}"'),
            ('"--port", "{free_port}"', f'"--port", "{stub_port}"'),
        ]
    for old, new in replacements:
        assert text.count(old) == 1, f"etc/hal0d.toml no longer has exactly one {old!r}"
        text = text.replace(old, new)
    # The Ollama listener's port too, so the demo runs beside `make run` there as well.
    assert text.count(DEMO_OLLAMA) == 1, f"etc/hal0d.toml no longer has one {DEMO_OLLAMA!r}"
    return text.replace(DEMO_OLLAMA, f'listen = "127.0.0.1:{free_port()}"')


def slot_views(port: int) -> list[dict[str, Any]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/slots", timeout=1) as resp:
            return cast(list[dict[str, Any]], json.loads(resp.read())["slots"])
    except (OSError, urllib.error.URLError, ValueError):
        return None


def slots_ready(port: int) -> bool:
    slots = slot_views(port)
    return bool(slots) and all(slot["state"] == "ready" for slot in slots or ())


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        # The stub runs in a session of its own, but dies with hal0d (its parent-death signal).
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


@contextmanager
def running_demo(tmp: Path, stub_port: int | None = None,
                 wait_ready: bool = True) -> Iterator[RunningDemo]:
    """The demo, served until the block ends; yields once its slot is ready (or, without
    `wait_ready`, once hal0d answers)."""
    port = free_port()
    config = tmp / "hal0d.toml"
    stub_log = tmp / "stub-reasoning.log"
    config.write_text(rewrite_demo_config(port, stub_log, stub_port))
    output = tmp / "hal0d.out"
    script = Path(sys.executable).parent / "hal0d"
    argv = [str(script)] if script.exists() else [sys.executable, "-m", "hal0d"]
    process = popen(config, output, program=argv, cwd=tmp, start_new_session=True)
    demo = RunningDemo(port, config, stub_log, output, process)
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while not (slots_ready(port) if wait_ready else slot_views(port) is not None):
            assert process.poll() is None, f"hal0d exited early\n{demo.diagnostics()}"
            assert time.monotonic() < deadline, f"slot not ready\n{demo.diagnostics()}"
            time.sleep(0.1)
        yield demo
    finally:
        stop(process)
