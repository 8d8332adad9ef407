"""Slot supervision over real sockets and real processes: a slot's `command` is launched, probed
until ready, restarted with backoff when it dies and stopped at shutdown; the periodic probe moves
a slot without a command between ready and error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE, SLOTS
from hal0d.lifecycle.runner import Runner
from hal0d_stub.app import make_stub_app
from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.ports import free_port

CHAT = "/v1/chat/completions"
STARTUP_S = 15.0  # a Python process importing aiohttp, on a busy two-core box


def stub_command(port: int, log: Path) -> tuple[str, ...]:
    return (
        sys.executable,
        "-m",
        "hal0d",
        "stub",
        "--port",
        str(port),
        "--log",
        str(log),
        "--delay",
        "0.001",
    )


async def slot_view(http: aiohttp.ClientSession, hal0d: TestServer) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert resp.status == 200
        return (await resp.json())["slots"][0]


async def wait_slot(
    http: aiohttp.ClientSession,
    hal0d: TestServer,
    check: Callable[[dict[str, Any]], bool],
    timeout: float,
) -> dict[str, Any]:
    async def matching() -> dict[str, Any]:
        view = await slot_view(http, hal0d)
        assert check(view), view
        return view

    return await eventually(matching, timeout, "the slot in the awaited state")


def slot_process(hal0d: TestServer) -> Runner:
    return hal0d.app[LIFECYCLE].runners["llm"]


async def start_with_command(start_hal0d, tmp_path: Path, **slot: Any) -> tuple[TestServer, Path]:
    port = free_port()
    log = tmp_path / "stub-process.log"
    hal0d = await start_hal0d(
        f"http://127.0.0.1:{port}", slot={"command": stub_command(port, log), **slot}
    )
    return hal0d, log


async def stream_ok(http: aiohttp.ClientSession, hal0d: TestServer) -> None:
    async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
        assert resp.status == 200
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


async def test_a_slot_command_goes_from_starting_to_ready_and_serves(start_hal0d, tmp_path, http):
    hal0d, log = await start_with_command(start_hal0d, tmp_path)
    first = await slot_view(http, hal0d)
    assert first["state"] == "starting"
    assert "launching" in first["reason"] and "stub" in first["reason"]
    view = await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
    assert view["reason"] is None
    await stream_ok(http, hal0d)
    # The stub writes its `end` line after its handler returns, a moment after the last byte.
    await eventually(lambda: any(" end " in line for line in log.read_text().splitlines()),
                     5, "the stub's end line")
    assert slot_process(hal0d).restarts == 0


async def test_a_killed_slot_process_is_logged_restarted_and_ready_again(
    start_hal0d, tmp_path, http
):
    hal0d, _ = await start_with_command(start_hal0d, tmp_path)
    await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
    process = slot_process(hal0d)
    assert process.child is not None
    old_pid = process.child.pid
    with capture_logs() as logs:
        os.kill(old_pid, signal.SIGKILL)
        died = await wait_slot(http, hal0d, lambda v: v["state"] == "error", 2.0)
        assert "killed by signal 9" in died["reason"]
        restarting = await wait_slot(http, hal0d, lambda v: v["state"] == "starting", 3.0)
        assert "launching" in restarting["reason"]
        await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
    assert process.restarts == 1
    assert process.child is not None and process.child.pid != old_pid
    exited = [e for e in logs if e["event"] == "slot.process_exited"]
    assert len(exited) == 1
    assert exited[0]["slot"] == "llm"
    assert exited[0]["code"] == -signal.SIGKILL
    assert exited[0]["restarts"] == 1 and exited[0]["restart_in_s"] > 0
    assert any(e["event"] == "slot.process_started" for e in logs)
    async with http.get(hal0d.make_url("/metrics")) as resp:
        assert 'hal0d_upstream_process_restarts_total{slot="llm"} 1.0' in await resp.text()
    await stream_ok(http, hal0d)


async def test_a_command_that_keeps_exiting_is_restarted_with_growing_backoff(start_hal0d, http):
    exits = (sys.executable, "-c", "raise SystemExit(3)")
    with capture_logs() as logs:
        hal0d = await start_hal0d(f"http://127.0.0.1:{free_port()}", slot={"command": exits})
        def exited_twice() -> list[dict[str, Any]]:
            exited = [e for e in logs if e["event"] == "slot.process_exited"]
            assert len(exited) >= 2, exited
            return exited

        exited = await eventually(exited_twice, 3.0 + STARTUP_S, "two slot.process_exited")
        view = await slot_view(http, hal0d)
    assert view["state"] in ("error", "starting")
    first, second = exited[:2]
    assert (first["code"], first["restarts"], second["restarts"]) == (3, 1, 2)
    assert second["restart_in_s"] > first["restart_in_s"] > 0
    started = [e for e in logs if e["event"] == "slot.process_started"]
    assert len(started) >= 2
    errors = [e for e in logs if e["event"] == "slot.state_changed" and e["new"] == "error"]
    assert errors and "exited with code 3" in errors[0]["reason"]


async def test_a_request_for_a_starting_slot_waits_in_the_queue_and_succeeds_once_ready(
    start_hal0d, tmp_path, http
):
    hal0d, _ = await start_with_command(start_hal0d, tmp_path)
    request = asyncio.create_task(stream_ok(http, hal0d))
    view = await wait_slot(http, hal0d, lambda v: v["queued"] == 1, 1.0)
    assert view["state"] == "starting"
    await asyncio.wait_for(request, STARTUP_S)
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        row = (await resp.json())["requests"]
    assert row and row[0]["ok"] is True
    assert row[0]["queue_ms"] > 50  # it waited for the process, not for a free place
    view = await slot_view(http, hal0d)
    assert (view["state"], view["in_flight"], view["queued"]) == ("ready", 0, 0)


async def test_a_slot_still_starting_at_queue_timeout_answers_503_slot_loading(
    start_hal0d, tmp_path, http
):
    port = free_port()
    never_listens = (sys.executable, "-c", "import time; time.sleep(60)")
    hal0d = await start_hal0d(
        f"http://127.0.0.1:{port}", slot={"command": never_listens, "queue_timeout_s": 0.3}
    )
    started = time.monotonic()
    async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
        assert resp.status == 503
        assert int(resp.headers["Retry-After"]) >= 1
        error = (await resp.json())["error"]
    assert 0.25 < time.monotonic() - started < 3.0
    assert error["code"] == "slot.loading"
    view = await slot_view(http, hal0d)
    assert (view["state"], view["queued"]) == ("starting", 0)


async def test_the_probe_moves_a_slot_without_command_to_error_and_back_to_ready(
    aiohttp_server, start_hal0d, tmp_path, http
):
    port = free_port()
    upstream = await aiohttp_server(make_stub_app(tmp_path / "a.log", 0.001), port=port)
    hal0d = await start_hal0d(f"http://127.0.0.1:{port}")
    lifecycle = hal0d.app[LIFECYCLE]
    assert (await slot_view(http, hal0d))["state"] == "ready"

    await upstream.close()
    await lifecycle.probe_once("llm")
    view = await slot_view(http, hal0d)
    assert view["state"] == "error"
    assert "cannot connect" in view["reason"]
    async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
        assert resp.status == 502  # still tried: the probe may be stale

    await aiohttp_server(make_stub_app(tmp_path / "b.log", 0.001), port=port)
    await lifecycle.probe_once("llm")
    view = await slot_view(http, hal0d)
    assert (view["state"], view["reason"]) == ("ready", None)
    await stream_ok(http, hal0d)


async def test_slot_processes_are_stopped_when_hal0d_shuts_down(start_hal0d, tmp_path, http):
    hal0d, _ = await start_with_command(start_hal0d, tmp_path)
    await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
    child = slot_process(hal0d).child
    assert child is not None
    process = child.process
    assert process is not None and process.returncode is None
    slots = hal0d.app[SLOTS]
    started = time.monotonic()
    try:
        async with asyncio.timeout(10):
            await hal0d.close()
    finally:
        if process.returncode is None:  # do not leak it past a failing test
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode is not None  # the stub exits 0 on SIGTERM, as aiohttp apps do
    assert time.monotonic() - started < 5.0
    assert str(slots["llm"].state) == "offline"
    try:
        os.kill(process.pid, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"stub process {process.pid} still exists")


async def test_a_process_printing_a_line_over_64_kib_keeps_running_and_is_logged_cut(
    start_hal0d, http
):
    # 70,000 characters on one line, then 400 KB more: were the pipe left unread after the long
    # line, the process would block on a full pipe and never reach its exit.
    noisy = (sys.executable, "-c",
             "import sys; print('x' * 70000, flush=True); "
             "[print('y' * 1000, flush=True) for _ in range(400)]; sys.exit(7)")
    with capture_logs() as logs:
        await start_hal0d(f"http://127.0.0.1:{free_port()}", slot={"command": noisy})
        await eventually(lambda: [e for e in logs if e["event"] == "slot.process_exited"], 10.0,
                         "the process got past its output and exited")
    exited = next(e for e in logs if e["event"] == "slot.process_exited")
    assert exited["code"] == 7
    lines = [e["line"] for e in logs if e["event"] == "slot.process_output"]
    assert lines[0].startswith("x" * 100) and "more bytes]" in lines[0]
    assert len(lines[0]) < 20_000
    assert sum(1 for line in lines if line == "y" * 1000) == 400


def kill_listed(pids_file: Path) -> None:
    """Kills every process whose pid a test's command wrote into `pids_file`."""
    if not pids_file.exists():
        return
    for pid in pids_file.read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


async def test_a_process_whose_child_holds_its_output_pipe_is_seen_to_exit(
    start_hal0d, tmp_path, http
):
    # The sleeper inherits the shell's stdout, hal0d's pipe, and holds it for a minute after the
    # stub (exec'd in the shell's place, so with its pid) is gone.
    port = free_port()
    sleepers = tmp_path / "sleepers"
    stub = " ".join(shlex.quote(arg) for arg in stub_command(port, tmp_path / "stub.log"))
    command = ("sh", "-c", f"sleep 60 & echo $! >> {shlex.quote(str(sleepers))}; exec {stub}")
    hal0d = await start_hal0d(f"http://127.0.0.1:{port}", slot={"command": command})
    try:
        await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
        child = slot_process(hal0d).child
        assert child is not None and "stub" in Path(f"/proc/{child.pid}/cmdline").read_text()
        with capture_logs() as logs:
            os.kill(child.pid, signal.SIGKILL)
            died = await wait_slot(http, hal0d, lambda v: v["state"] != "ready", 5.0)
            assert died["state"] == "error", died
            assert died["reason"].startswith("process killed by signal 9 (SIGKILL)"), died
            await wait_slot(http, hal0d, lambda v: v["state"] == "ready", STARTUP_S)
        exited = [e for e in logs if e["event"] == "slot.process_exited"]
        assert [(e["code"], e["restarts"]) for e in exited] == [(-signal.SIGKILL, 1)]
        await stream_ok(http, hal0d)
        assert len(sleepers.read_text().split()) == 2  # the restarted command's own sleeper
    finally:
        kill_listed(sleepers)
