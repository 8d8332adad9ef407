"""One process machine for both kinds of slot: an `always` slot whose process dies is started
again with the same backoff an on-demand slot's failed load refuses for, and the requests that
wanted the dead process wait for the restart instead of meeting its closed port, over real
processes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shlex
import signal
import sys
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE, SLOTS
from hal0d.config import SlotConfig
from hal0d.errors import SlotLoadFailed
from hal0d.lifecycle.manager import EXIT_SEEN_S
from hal0d.lifecycle.runner import BACKOFF_FIRST_S
from tests.harness.client import CHAT, body, chat, state_is
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import stub_command


def always(name: str, tmp_path: Path) -> SlotConfig:
    port = free_port()
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=stub_command(port, tmp_path / f"{name}.log"))


def nth(logs: list[dict[str, Any]], event: str, slot: str, n: int) -> dict[str, Any]:
    """The n-th (from 1) `event` of `slot` in the captured log; an AssertionError ("not yet")
    while there are fewer."""
    found = [entry for entry in logs if entry["event"] == event and entry.get("slot") == slot]
    assert len(found) >= n, found
    return found[n - 1]


async def test_an_always_slot_whose_process_dies_is_restarted_with_the_on_demand_backoff(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    failing = on_demand("c", tmp_path, "--fail-start", "error: no such model file")
    hal0d = await start(start_hal0d, build_config(tmp_path, always("a", tmp_path), failing))
    await state_is(http, hal0d, "a", "ready")
    runner = hal0d.app[LIFECYCLE].runners["a"]
    with capture_logs() as logs:
        for attempt in (1, 2):
            child = runner.child
            assert child is not None
            os.kill(child.pid, signal.SIGKILL)
            exited = await eventually(lambda n=attempt: nth(logs, "slot.process_exited", "a", n),
                                      5, "the always slot's exit")
            seen_exit = time.monotonic()
            await eventually(lambda n=attempt: nth(logs, "slot.process_started", "a", n),
                             BACKOFF_FIRST_S * attempt + 5, "the always slot started again")
            waited = time.monotonic() - seen_exit
            # Not started again before its backoff (the exit is seen at most a poll late).
            assert waited >= exited["restart_in_s"] - 0.1, (waited, exited)
            view = await state_is(http, hal0d, "a", "ready")
            assert view["reason"] is None
            status, answer = await chat(http, hal0d, "tool")
            assert status == 503 and answer["error"]["code"] == "slot.load_failed", answer
            failed = nth(logs, "slot.load_failed", "c", attempt)
            # The same backoff, step for step: 1 s, then 2 s.
            assert exited["restart_in_s"] == failed["retry_in_s"] == BACKOFF_FIRST_S * attempt
            if attempt == 1:
                # Past c's refusal, so that its next load is tried (and fails) again.
                await asyncio.sleep(failed["retry_in_s"])
    assert runner.restarts == 2


# -- a process that exits while it is wanted holds its slot until the restart answers ---------

# A slot process that serves the stub until SIGUSR1, then closes its sockets (connects are
# refused) and still runs for EXIT_AFTER_S before it exits: the instant between a process's
# death and hal0d seeing its exit, stretched so that a test can be inside it.
CLOSES_THEN_EXITS = """
import asyncio, os, signal, sys
from pathlib import Path
from aiohttp import web
from hal0d_stub.app import make_stub_app

async def main(port: int, log: str, exit_after: float) -> None:
    runner = web.AppRunner(make_stub_app(Path(log), 0.001))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    closing = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, closing.set)
    await closing.wait()
    await runner.cleanup()  # its listener and its connections closed, as a dead process's are
    print("sockets closed", flush=True)
    await asyncio.sleep(exit_after)
    os._exit(3)

asyncio.run(main(int(sys.argv[1]), sys.argv[2], float(sys.argv[3])))
"""
EXIT_AFTER_S = 0.5


def closes_then_exits(name: str, tmp_path: Path, **keys: Any) -> SlotConfig:
    port = free_port()
    command = (sys.executable, "-c", CLOSES_THEN_EXITS, str(port),
               str(tmp_path / f"{name}.log"), str(EXIT_AFTER_S))
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=command, **keys)


def fails_once_restarted(name: str, tmp_path: Path, **keys: Any) -> SlotConfig:
    """The stub the first time, a process that cannot load its model every time after."""
    port = free_port()
    marker = shlex.quote(str(tmp_path / f"{name}.started"))
    stub = " ".join(shlex.quote(arg) for arg in stub_command(port, tmp_path / f"{name}.log"))
    script = (f"if [ -e {marker} ]; then echo 'error: the model file is gone'; exit 1; fi; "
              f": > {marker}; exec {stub}")
    return SlotConfig(name=name, upstream=f"http://127.0.0.1:{port}", models=("chat",),
                      command=("sh", "-c", script), **keys)


async def refused(upstream: str) -> bool:
    """Whether a connect to `upstream` is refused now (one reset as the listener closes is
    not yet)."""
    port = int(upstream.rsplit(":", 1)[1])
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    except ConnectionResetError:
        return False
    writer.close()
    return False


async def test_requests_queued_when_a_process_exits_wait_for_its_restart_instead_of_a_502(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = dataclasses.replace(always("a", tmp_path), max_concurrent=1)
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    await state_is(http, hal0d, "a", "ready")
    slot, runner = hal0d.app[SLOTS]["a"], hal0d.app[LIFECYCLE].runners["a"]
    with capture_logs() as logs:
        async with AsyncExitStack() as held:
            await held.enter_async_context(slot.lease())  # the one place, as a stream holds it
            queued = asyncio.create_task(chat(http, hal0d, "chat"))
            await eventually(lambda: slot.queued == 1, 5, "the request queued")
            assert runner.child is not None
            os.kill(runner.child.pid, signal.SIGKILL)
            await state_is(http, hal0d, "a", "error", 5)
            late = asyncio.create_task(chat(http, hal0d, "chat"))  # during the backoff
            await eventually(lambda: slot.queued == 2, 5, "the late request queued")
        # The place is free while no process listens: nothing is granted until the restart.
        assert (slot.queued, slot.in_flight) == (2, 0), f"granted with no process: {slot}"
        answers = await asyncio.gather(queued, late)
    assert [status for status, _ in answers] == [200, 200], answers
    assert len([e for e in logs if e["event"] == "slot.process_started"]) == 1
    assert slot.load_refused is None and slot.state.value == "ready"


async def test_a_request_queued_past_its_bound_during_a_restart_gets_503_with_retry_after(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = dataclasses.replace(always("a", tmp_path), max_concurrent=1, queue_timeout_s=0.3)
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    await state_is(http, hal0d, "a", "ready")
    runner = hal0d.app[LIFECYCLE].runners["a"]
    assert runner.child is not None
    os.kill(runner.child.pid, signal.SIGKILL)
    await state_is(http, hal0d, "a", "error", 5)
    async with http.post(hal0d.make_url(CHAT), json=body("chat")) as resp:
        assert resp.status == 503, await resp.text()
        assert int(resp.headers["Retry-After"]) >= 1
        error = (await resp.json())["error"]
    assert error["code"] == "slot.loading" and "start again" in error["message"], error


async def test_a_lease_refused_as_its_process_dies_is_told_when_the_restart_is_up(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = closes_then_exits("a", tmp_path)
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    await state_is(http, hal0d, "a", "ready")
    slot, runner = hal0d.app[SLOTS]["a"], hal0d.app[LIFECYCLE].runners["a"]
    old = runner.child
    assert old is not None
    async with slot.lease():
        # Its process runs and answers: a refusal would be the upstream's own (a 502 stands).
        started = time.monotonic()
        assert await slot.process_fate() is False
        assert time.monotonic() - started >= EXIT_SEEN_S - 0.1
        os.kill(old.pid, signal.SIGUSR1)
        await eventually(lambda: refused(config.upstream), 5, "its sockets closed")
        assert slot.state.value == "serving"  # granted now, its process's exit not yet seen
        assert await slot.process_fate() is True  # after the exit, the backoff, the restart
        assert runner.child is not None and runner.child.pid != old.pid
        assert slot.state.value == "serving"
    assert slot.state.value == "ready"


@pytest.mark.parametrize("start_policy", ["always", "on_demand"])
async def test_a_lease_waiting_for_a_restart_that_fails_gets_503_and_the_slot_goes_on(
    start_policy: str, start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    # A bound of its own (an on-demand slot's lease waits up to load_timeout_s for a restart).
    config = fails_once_restarted("a", tmp_path, start=start_policy, load_timeout_s=15.0)
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    if start_policy == "on_demand":
        assert (await chat(http, hal0d, "chat"))[0] == 200  # its first load
    await state_is(http, hal0d, "a", "ready")
    slot, runner = hal0d.app[SLOTS]["a"], hal0d.app[LIFECYCLE].runners["a"]
    with capture_logs() as logs:
        async with slot.lease():
            assert runner.child is not None
            os.kill(runner.child.pid, signal.SIGKILL)
            await eventually(lambda: refused(config.upstream), 5, "the port closed")
            with pytest.raises(SlotLoadFailed) as failed:
                await slot.process_fate()
        assert "the model file is gone" in str(failed.value) and failed.value.retry_after
        # The restart failed with the lease in flight: in error, retried while wanted, so an
        # on-demand slot rests once its backoff has passed.
        rest = "stopped" if start_policy == "on_demand" else "error"
        await state_is(http, hal0d, "a", rest, 10)
    assert not [e for e in logs if e["event"] == "lifecycle.task_failed"], logs


async def test_a_request_refused_in_the_instant_its_process_dies_is_served_after_the_restart(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = closes_then_exits("a", tmp_path)
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    await state_is(http, hal0d, "a", "ready")
    runner = hal0d.app[LIFECYCLE].runners["a"]
    assert runner.child is not None
    os.kill(runner.child.pid, signal.SIGUSR1)
    await eventually(lambda: refused(config.upstream), 5, "its sockets closed")
    status, answer = await chat(http, hal0d, "chat")
    assert status == 200, answer
