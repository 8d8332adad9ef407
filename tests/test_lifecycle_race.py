"""Admin calls and requests at once: one on-demand slot (the real stub, listening after 0.3 s,
`idle_unload_s = 1`) under clients that each pick, at random, a load, a load without waiting, an
unload, a forced unload or a short streamed chat. Real sockets, real processes.

What must hold, whatever the interleaving: every call gets an HTTP answer in its envelope (no
500, no connection closed without a status); no request waits past its bound; whenever the
lifecycle manager has no start or stop under way, the slot's state and pid match the processes
alive (loaded: exactly that pid; stopped: none), and a process hal0d started is either the
slot's tracked one or already gone; once hal0d stops, none is alive.

The storm lasts STORM_S (a few seconds in `make test`); `make soak` runs it for longer with
HAL0D_STORM_S. On a box so busy that STORM_S held too few calls to have done every kind (a
served chat, a forced unload, a sample taken while the manager was busy), it goes on until it
has, for STORM_MORE_S at most, and the test then says what was missing.
"""

from __future__ import annotations

import asyncio
import collections
import os
import random
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE
from hal0d.lifecycle.slots import SlotState
from tests.harness.client import CHAT, body, state_is
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.processes import stub_pids

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone

STORM_S = float(os.environ.get("HAL0D_STORM_S", "4"))
STORM_MORE_S = 20.0  # the most the storm goes on past STORM_S for a kind it has not done yet
CLIENTS = 16
SEED = 27
QUEUE_TIMEOUT_S = 5.0
LOAD_TIMEOUT_S = 8.0
# The longest a call may take: a chat waits at most the load timeout (an on-demand slot's queue
# bound), an API load at most for an unload and a load; a margin for a busy two-core box.
MARGIN_S = 2.0
BOUND_S = {"chat": max(QUEUE_TIMEOUT_S, LOAD_TIMEOUT_S) + MARGIN_S,
           "load": 2 * LOAD_TIMEOUT_S + MARGIN_S}
ALLOWED = {"load": {200, 503}, "load_nowait": {202}, "unload": {200, 409},
           "unload_force": {200}, "chat": {200, 429, 503}}
# How often each call is picked: a forced unload cancels any load under way, and a load takes
# ~0.6 s here, so a storm of equal picks would never see a model serve; rarer, it cuts loads,
# streams and queues at random moments all the same.
WEIGHTS = {"load": 8, "load_nowait": 8, "unload": 8, "unload_force": 1, "chat": 30}


async def one_call(http: aiohttp.ClientSession, url: str, what: str) -> tuple[str, int, float]:
    """(what, status, seconds) of one call; any status is read with its body, and a call that
    gets no HTTP answer at all raises (the test fails on it)."""
    started = time.monotonic()
    paths = {"load": "/api/slots/a/load", "load_nowait": "/api/slots/a/load?wait=false",
             "unload": "/api/slots/a/unload", "unload_force": "/api/slots/a/unload?force=true"}
    if what == "chat":
        async with http.post(url + CHAT, json=body("chat", stream=True, max_tokens=4)) as resp:
            data = await resp.read()
            if resp.status == 200:
                # Whole, or ended by a forced unload with its terminal frame: never torn.
                assert data.endswith(b"data: [DONE]\n\n"), data[-200:]
            else:
                assert b'"error"' in data, data
                assert resp.status != 503 or "Retry-After" in resp.headers, resp.headers
            return what, resp.status, time.monotonic() - started
    async with http.post(url + paths[what]) as resp:
        data = await resp.read()
        if resp.status >= 400:
            assert b'"error"' in data, data
            assert resp.status != 503 or "Retry-After" in resp.headers, resp.headers
        return what, resp.status, time.monotonic() - started


# Lines that only a bug of hal0d's writes: a task of the lifecycle manager that raised (an event
# the table refused, say), a request that ended in a 500.
BUG_EVENTS = frozenset({"lifecycle.task_failed", "request.failed", "slot.listener_failed"})


def no_bug_logged(logs: list[dict[str, Any]]) -> None:
    bugs = [entry for entry in logs if entry["event"] in BUG_EVENTS
            or (entry.get("log_level") in ("error", "critical") and "exc_info" in entry)]
    assert bugs == [], bugs


def check_consistent(hal0d: TestServer, marker: str, seen: collections.Counter[str]) -> None:
    """The slot's state and tracked pid against the processes alive, read in one turn of the
    event loop (nothing in hal0d moves meanwhile). Always: at most one process alive, and none
    but the tracked one when one is tracked (a start between its fork and its record, or a stop
    between its record cleared and the exit, holds one untracked). With no start or stop under
    way, the state says exactly what is alive."""
    runner = hal0d.app[LIFECYCLE].runners["a"]
    alive = stub_pids(marker)
    tracked = runner.child.pid if runner.child is not None else None
    assert len(alive) <= 1, alive
    if tracked is not None:
        assert alive <= {tracked}, (tracked, alive)
    if runner.busy:
        seen["busy"] += 1
        return
    state = runner.slot.state
    seen[str(state)] += 1
    if state in (SlotState.READY, SlotState.SERVING):
        assert tracked is not None and alive == {tracked}, (state, tracked, alive)
    elif state is SlotState.STOPPED:
        assert tracked is None and alive == set(), (state, tracked, alive)
    else:
        assert alive <= ({tracked} if tracked else set()), (state, tracked, alive)


async def test_loads_unloads_forced_unloads_and_requests_at_once_keep_one_truth(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", "0.3", idle_unload_s=1.0,
                     queue_timeout_s=QUEUE_TIMEOUT_S, load_timeout_s=LOAD_TIMEOUT_S)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    url = str(hal0d.make_url("")).rstrip("/")
    marker = str(tmp_path)
    rng = random.Random(SEED)
    results: list[tuple[str, int, float]] = []
    seen: collections.Counter[str] = collections.Counter()
    deadline = time.monotonic() + STORM_S

    def storming() -> bool:
        """Until STORM_S is over and the storm has done every kind the asserts below ask for
        (or STORM_MORE_S more have passed)."""
        now = time.monotonic()
        if now < deadline:
            return True
        done = {(what, status) for what, status, _ in results}
        did_its_work = ({what for what, _ in done} == set(ALLOWED) and ("chat", 200) in done
                        and ("unload_force", 200) in done and seen["busy"] > 0
                        and sum(seen.values()) > seen["busy"])
        return not did_its_work and now < deadline + STORM_MORE_S

    async def client() -> None:
        while storming():
            what = rng.choices(list(WEIGHTS), weights=list(WEIGHTS.values()))[0]
            results.append(await one_call(http, url, what))
            await asyncio.sleep(rng.uniform(0, 0.3))  # moments of calm too, to be sampled

    async def sample() -> None:
        while storming():
            check_consistent(hal0d, marker, seen)
            await asyncio.sleep(0.02)

    with capture_logs() as logs:
        await asyncio.gather(sample(), *(client() for _ in range(CLIENTS)))
    no_bug_logged(logs)

    by_kind = collections.Counter((what, status) for what, status, _ in results)
    for what, status, took in results:
        assert status in ALLOWED[what], (what, status, by_kind)
        assert took < BOUND_S.get(what, MARGIN_S), (what, status, took)
    # The storm did what it is for: every kind of call, loads that served and forced unloads.
    assert {what for what, _, _ in results} == set(ALLOWED), by_kind
    assert by_kind[("chat", 200)] > 0 and by_kind[("unload_force", 200)] > 0, by_kind
    assert seen["busy"] > 0 and sum(seen.values()) > seen["busy"], seen

    # Settled: nothing under way, and the slot says what is alive.
    lifecycle = hal0d.app[LIFECYCLE]
    await eventually(lambda: not lifecycle.runners["a"].busy, STARTUP_S, "the slot settled")
    check_consistent(hal0d, marker, seen)
    view = await state_is(http, hal0d, "a", "stopped", timeout=STARTUP_S)  # idle_unload_s
    assert (view["in_flight"], view["queued"], view["pid"]) == (0, 0, None)
    assert stub_pids(marker) == set()
    await hal0d.close()
    assert stub_pids(marker) == set()


async def test_a_forced_unload_during_a_load_answers_its_waiters_at_once_and_stops_its_process(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", "2")
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    url = str(hal0d.make_url("")).rstrip("/")
    marker = str(tmp_path)
    with capture_logs() as logs:
        waiters = [asyncio.create_task(one_call(http, url, "chat")) for _ in range(3)]
        loading = asyncio.create_task(one_call(http, url, "load"))
        await eventually(lambda: stub_pids(marker), STARTUP_S, "the load's process started")
        started = time.monotonic()
        what, status, _ = await one_call(http, url, "unload_force")
        assert (what, status) == ("unload_force", 200)
        answers = await asyncio.gather(*waiters, loading)
        assert time.monotonic() - started < 1.0  # at once, not after the 2 s start
    no_bug_logged(logs)
    assert [status for _, status, _ in answers] == [503, 503, 503, 503], answers
    assert stub_pids(marker) == set()
    view = await state_is(http, hal0d, "a", "stopped", timeout=1.0)
    assert view["pid"] is None


async def test_a_load_during_an_unload_waits_for_it_then_loads(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    url = str(hal0d.make_url("")).rstrip("/")
    assert (await one_call(http, url, "load"))[1] == 200
    first = hal0d.app[LIFECYCLE].runners["a"].child
    assert first is not None
    # A stream holds the unload in `stopping` (it drains) while the load asks.
    with capture_logs() as logs:
        async with http.post(url + CHAT, json=body("chat", stream=True, max_tokens=40)) as stream:
            assert stream.status == 200
            unloading = asyncio.create_task(one_call(http, url, "unload"))
            await state_is(http, hal0d, "a", "stopping", timeout=2.0)
            loading = asyncio.create_task(one_call(http, url, "load"))
            assert (await stream.read()).endswith(b"data: [DONE]\n\n")
        assert (await unloading)[1] == 200
        assert (await loading)[1] == 200
    no_bug_logged(logs)
    view = (await state_is(http, hal0d, "a", "ready", timeout=1.0))
    second = hal0d.app[LIFECYCLE].runners["a"].child
    assert second is not None and view["pid"] == second.pid != first.pid
    assert stub_pids(str(tmp_path)) == {second.pid}
