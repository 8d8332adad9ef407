"""Slot processes never outlive hal0d, however it dies: each one is started with a parent-death
signal (Linux's PR_SET_PDEATHSIG) in a session of its own, on asyncio's loop and on uvloop alike,
and a kill -9 of a real `hal0d serve` takes its slot processes along.

Real processes throughout; the pids come from hal0d's own `slot.process_started` log lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from structlog.testing import capture_logs

from hal0d.config import SlotConfig
from hal0d.lifecycle.manager import LifecycleManager
from hal0d.lifecycle.process import PARENT_DEATH_SIGNAL, PRCTL
from hal0d.lifecycle.table import SlotTable
from hal0d.transport.upstream import UpstreamClient
from tests.harness.daemons import popen
from tests.harness.ports import free_port
from tests.harness.processes import kill_with_its_group, process_state, running

pytestmark = pytest.mark.skipif(PRCTL is None, reason="parent-death signals are Linux's prctl")

READY_WITHIN_S = 20.0  # two Python processes importing aiohttp on a busy two-core box
GONE_WITHIN_S = 2.0

# Prints what the kernel holds for the process itself: its parent-death signal
# (PR_GET_PDEATHSIG = 2), whether it leads its own session, and its parent.
REPORT_ITSELF = (
    "import ctypes, os; signum = ctypes.c_int(); "
    "ctypes.CDLL(None).prctl(2, ctypes.byref(signum)); "
    "print(f'pdeathsig={signum.value} session_leader={os.getsid(0) == os.getpid()} "
    "ppid={os.getppid()}', flush=True)"
)


def run_on(loop_name: str, main: Callable[[], Coroutine[Any, Any, str]]) -> str:
    if loop_name == "uvloop":
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main())
    return asyncio.run(main())


@pytest.mark.parametrize("loop_name", ["asyncio", "uvloop"])
def test_a_slot_process_gets_the_parent_death_signal_and_a_session_of_its_own(
    loop_name: str,
) -> None:
    """A slot process's real start (the lifecycle manager's), on both loops hal0d can run on:
    uvloop (what `hal0d serve` uses) and asyncio's own (the in-process tests). Either loop could
    drop preexec_fn or start_new_session silently; the process reports what the kernel holds
    for it."""

    async def main() -> str:
        config = SlotConfig(name="llm", upstream=f"http://127.0.0.1:{free_port()}",
                            models=("chat",), command=(sys.executable, "-c", REPORT_ITSELF))
        async with aiohttp.ClientSession() as session:
            lifecycle = LifecycleManager(SlotTable([config]), [config], UpstreamClient(session))
            with capture_logs() as logs:
                await lifecycle.start()
                try:
                    async with asyncio.timeout(READY_WITHIN_S):
                        while not (lines := [e["line"] for e in logs
                                             if e["event"] == "slot.process_output"]):
                            await asyncio.sleep(0.02)
                finally:
                    await lifecycle.stop()
        return str(lines[0])

    line = run_on(loop_name, main)
    assert line == (f"pdeathsig={int(PARENT_DEATH_SIGNAL)} session_leader=True "
                    f"ppid={os.getpid()}"), line


# The parent builds the hook, forks and dies at once; the child waits until it is an orphan,
# then runs the hook, as a slot process would had hal0d died between its fork and the prctl.
ORPHANED_BEFORE_THE_HOOK = textwrap.dedent("""
    import os, sys, time
    from hal0d.lifecycle.process import die_with_hal0d
    hook = die_with_hal0d()
    parent = os.getpid()
    if os.fork():
        os._exit(0)
    deadline = time.monotonic() + 10
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"orphaned {os.getpid()}", flush=True)
    hook()
    print("went on to exec", flush=True)
""")


def test_a_child_orphaned_before_it_set_the_signal_exits_instead_of_starting() -> None:
    """The race the hook closes: the death signal is set only after the fork, so a parent that
    died in between would never send it. The hook sees the changed parent and exits."""
    result = subprocess.run([sys.executable, "-c", ORPHANED_BEFORE_THE_HOOK],
                            capture_output=True, text=True, timeout=20)
    lines = result.stdout.splitlines()
    assert len(lines) == 1 and lines[0].startswith("orphaned "), (lines, result.stderr)
    child = int(lines[0].split()[1])
    # stdout reached EOF, so the child has exited; as the suite's subreaper we can reap it.
    with contextlib.suppress(ChildProcessError):
        reaped, status = os.waitpid(child, 0)
        assert reaped == child and os.waitstatus_to_exitcode(status) == 1


def two_slot_config(port: int, stub_ports: tuple[int, int], tmp_path: Path) -> str:
    slots = "".join(textwrap.dedent(f"""
        [[slots]]
        name = "{name}"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["{name}"]
        command = ["hal0d", "stub", "--port", "{stub_port}"]
    """) for name, stub_port in zip(("first", "second"), stub_ports, strict=True))
    return textwrap.dedent(f"""
        [server]
        host = "127.0.0.1"
        port = {port}

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """) + slots


def slots_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/slots", timeout=1) as resp:
            slots = json.loads(resp.read())["slots"]
    except (OSError, urllib.error.URLError, ValueError):
        return False
    return len(slots) == 2 and all(slot["state"] == "ready" for slot in slots)


def started_pids(log: Path) -> dict[str, int]:
    """slot name -> pid, from hal0d's `slot.process_started` lines."""
    pids = {}
    for line in log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if event.get("event") == "slot.process_started":
                pids[event["slot"]] = int(event["pid"])
    return pids


@pytest.fixture
def serving_two_slots(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], dict[str, int]]]:
    """A real `hal0d serve` (uvloop, as in production) with two `hal0d stub` slot processes, both
    ready; yields hal0d's process and the slot pids its log names."""
    port, first, second = free_port(), free_port(), free_port()
    assert len({port, first, second}) == 3
    config = tmp_path / "hal0d.toml"
    config.write_text(two_slot_config(port, (first, second), tmp_path))
    log = tmp_path / "hal0d.log"
    hal0d = popen(config, log)
    pids: dict[str, int] = {}
    try:
        deadline = time.monotonic() + READY_WITHIN_S
        while not slots_ready(port) or len(pids := started_pids(log)) < 2:
            assert hal0d.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        yield hal0d, pids
    finally:
        for pid in (*pids.values(), hal0d.pid):
            if running(pid):  # the test failed: leave nothing behind
                kill_with_its_group(pid)
        hal0d.wait(timeout=10)
        for pid in pids.values():
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)  # orphans of the killed hal0d, re-parented to us


def test_kill_9_of_hal0d_ends_both_of_its_slot_processes_within_2_s(
    serving_two_slots: tuple[subprocess.Popen[bytes], dict[str, int]],
) -> None:
    hal0d, pids = serving_two_slots
    for pid in pids.values():
        state = process_state(pid)
        assert state is not None and state[1] == hal0d.pid, (pid, state)  # hal0d's, running
        assert b"stub" in Path(f"/proc/{pid}/cmdline").read_bytes()

    os.kill(hal0d.pid, signal.SIGKILL)  # no handler, no cleanup: only the kernel acts
    killed = time.monotonic()
    hal0d.wait(timeout=10)
    while any(running(pid) for pid in pids.values()):
        if time.monotonic() - killed > GONE_WITHIN_S:
            left = {name: pid for name, pid in pids.items() if running(pid)}
            raise AssertionError(f"slot processes still running {GONE_WITHIN_S} s after "
                                 f"hal0d's SIGKILL: {left}")
        time.sleep(0.02)
