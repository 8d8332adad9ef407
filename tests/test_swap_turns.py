"""A busy model's turn in a group of `max_loaded = 1`, over real sockets with the stub as each
slot's command: priced by what a swap of its group measurably costs (slower loads, longer turns).
Three busy models each get their turns, no request is refused while it waits for one, and none
waits past the bound /api/slots gives; a model with no work is swapped out at once, whatever its
minimum turn; a turn that is over never cuts the request in flight."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.config import SlotConfig
from tests.harness.client import CHAT, body, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.swaps import LOAD_S, LONG_TURN_LOADS, PidLog, streamed, swap_group, two_models

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone


# -- turns priced by what a swap costs ---------------------------------------------------------

THREE = {"a": "chat", "b": "think-only", "c": "tool"}


def three_models(where: Path, **keys: Any) -> list[SlotConfig]:
    where.mkdir(exist_ok=True)
    return [on_demand(name, where, "--startup-delay", "1", group="gpu0", **keys)
            for name in THREE]


async def timed_loop(http: aiohttp.ClientSession, hal0d: TestServer, seconds: float,
                     clients_per_model: int = 3) -> list[tuple[str, int, float]]:
    """Closed-loop clients on the three models: each request's model, status and latency."""
    answers: list[tuple[str, int, float]] = []
    until = time.monotonic() + seconds

    async def client(model: str) -> None:
        while time.monotonic() < until:
            began = time.monotonic()
            status = await streamed(http, hal0d, model)
            answers.append((model, status, time.monotonic() - began))

    await asyncio.gather(*(client(model) for model in THREE.values()
                           for _ in range(clients_per_model)))
    return answers


async def group_view(http: aiohttp.ClientSession, hal0d: TestServer) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        [group] = (await resp.json())["groups"]
        return dict(group)


async def test_three_busy_models_each_get_turns_none_refused_none_past_the_bound(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Three models loading for about 1 s, three clients each for 14 s, fifo and batch side by
    side; batch's turns are priced by the swaps it measures (swapping at most half the time, so
    that each model has turns in 14 s), so it is
    answered at least twice as often, every model many times; no request is refused while its
    model waits for a turn though each slot's queue_timeout_s is 1 s and its load_timeout_s 5 s
    (the wait for a turn grows its queue's bound: fifo's too); and none waits past the bound
    /api/slots gives (wait_bound_s), plus its own load. Never are two loaded."""
    runs: dict[str, tuple[TestServer, PidLog]] = {}
    for policy in ("fifo", "batch"):
        where = tmp_path / policy
        hal0d = await start(start_hal0d, build_config(
            where, *three_models(where, queue_timeout_s=1.0, load_timeout_s=5.0),
            groups=swap_group(policy, min_turn_loads=0.0, max_swap_share=0.5)))
        runs[policy] = (hal0d, PidLog(str(where)))
    for _, sampler in runs.values():
        sampler.start()
    try:
        results = await asyncio.gather(*(timed_loop(http, hal0d, 14.0)
                                         for hal0d, _ in runs.values()))
    finally:
        for _, sampler in runs.values():
            sampler.__exit__()
    loads = {policy: len(sampler.pids) for policy, (_, sampler) in runs.items()}
    answered = {policy: len(answers) for policy, answers in zip(runs, results, strict=True)}
    batch = await views(http, runs["batch"][0])
    group = await group_view(http, runs["batch"][0])
    load_s = max(view["load_s"] for view in batch.values() if view["load_s"] is not None)
    bound_s = group["wait_bound_s"]  # about the longest wait for a turn, by the measured swaps
    slowest = max(latency for _, _, latency in results[1])
    per_model = {model: sum(1 for m, _, _ in results[1] if m == model) for model in THREE.values()}
    print(f"\nthree models, 14 s: loads {loads}, answered {answered}; batch: per model "
          f"{per_model}, slowest {slowest:.2f} s, wait_bound_s {bound_s} s, load {load_s} s, "
          f"turn {group['turn_s']} s, swap {group['swap_cost_s']} s, share "
          f"{group['swap_share']}")
    for answers in results:
        assert answers and {status for _, status, _ in answers} == {200}
    for _, sampler in runs.values():
        assert sampler.samples > 100 and sampler.most_alive == 1
    assert answered["batch"] >= 2 * answered["fifo"], answered
    assert min(per_model.values()) >= 10, per_model  # each model had turns, not one
    # A queue's bound for a turn counts every load ahead as long as load_timeout_s allows.
    turn = group["turn_s"]
    assert all(view["turn_wait_s"] >= 2 * (5.0 + turn) - 0.2 for view in batch.values())
    # The turn a swap's measured cost prices, at most half the time swapping: one swap long.
    cost = group["swap_cost_s"]
    assert group["swaps"] >= 2 and turn == pytest.approx(cost, abs=0.11), group
    # The documented bound: the turns and swaps of the two others, then its own load, plus
    # the spread of loads that run beside the other hal0d's: 2 s in all.
    assert slowest <= bound_s + load_s + 2.0, (slowest, bound_s, load_s)


async def busy_then_other(http: aiohttp.ClientSession, hal0d: TestServer,
                          ) -> tuple[float, float, dict[str, Any], dict[str, Any]]:
    """a loaded, b swapped in and out (a swap measured each way), then a busy with three
    streams when b is asked for: what was left of a's turn as b asked, how long b waited, the
    swap that waited as /api/slots showed it, and the group's view as b asked."""
    for model in ("chat", "think-only", "chat"):
        assert await streamed(http, hal0d, model) == 200
    stop = asyncio.Event()

    async def stream_for_a() -> None:
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200

    streams = [asyncio.create_task(stream_for_a()) for _ in range(3)]
    group = await group_view(http, hal0d)
    asked = time.monotonic()
    turn_left_s = group["turn_ends_in_s"]["a"]
    for_b = asyncio.create_task(streamed(http, hal0d, "think-only"))

    swap: dict[str, Any] = {}

    async def pending() -> bool:
        swap.update((await views(http, hal0d))["b"]["pending_swap"] or {})
        return bool(swap)

    await eventually(pending, 5, "b's pending swap")
    assert await for_b == 200
    waited_s = time.monotonic() - asked
    stop.set()
    await asyncio.gather(*streams)
    return turn_left_s, waited_s, swap, group


async def test_a_busy_model_keeps_its_turn_for_as_long_as_a_measured_swap_prices_it(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Two groups side by side, one whose models load in 0.3 s and one in 1.5 s: after a swap
    each way, the slower group's turn is the longer by what its swaps measurably cost, and in
    each a busy a keeps the group until its turn is over while b waits, as /api/slots said
    (turn_ends_in_s, the pending swap's turn_at_s); the history's turn_ms says b waited."""
    servers: dict[str, TestServer] = {}
    for label, load_s in (("fast", "0.3"), ("slow", "1.5")):
        where = tmp_path / label
        where.mkdir()
        slots = [on_demand(name, where, "--startup-delay", load_s, group="gpu0")
                 for name in ("a", "b")]
        servers[label] = await start(start_hal0d, build_config(
            where, *slots, groups=swap_group("batch", min_turn_loads=0.0)))
    with capture_logs() as logs:
        fast, slow = await asyncio.gather(*(busy_then_other(http, hal0d)
                                            for hal0d in servers.values()))
    print(f"\nfast: {fast}\nslow: {slow}")
    for turn_left_s, waited_s, swap, group in (fast, slow):
        cost = group["swap_cost_s"]
        assert group["swaps"] == 2 and group["turn_s"] == pytest.approx(4 * cost, abs=0.11)
        assert turn_left_s > 0.5 and waited_s >= turn_left_s - 0.15, (turn_left_s, waited_s)
        assert swap["turn_at_s"] == pytest.approx(turn_left_s, abs=0.4)
        assert swap["max_wait_s"] is None
    assert slow[3]["swap_cost_s"] > fast[3]["swap_cost_s"] + 0.8
    assert slow[3]["turn_s"] > fast[3]["turn_s"] + 3.2, (fast[3], slow[3])
    started = [e for e in logs if e["event"] == "swap.started" and e["slot"] == "b"]
    # In each: b for an idle a, then b once a's turn was over.
    assert sorted("a's turn is over (" in e["why"] for e in started) == [False, False, True, True]
    for label, (turn_left_s, _, _, _) in zip(servers, (fast, slow), strict=True):
        async with http.get(servers[label].make_url("/api/requests?limit=1000")) as resp:
            rows = (await resp.json())["requests"]
        last_b = next(r for r in rows if r["model"] == "think-only")  # newest first
        assert last_b["turn_ms"] >= (turn_left_s - 0.2) * 1000, (last_b, turn_left_s)


async def test_a_model_with_no_work_is_swapped_out_at_once_whatever_its_minimum_turn(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """No minimum turn for nobody: a model with nothing queued or in flight goes as soon as
    another is asked for, though its turn of 50 loads is far from over."""
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", min_turn_loads=LONG_TURN_LOADS)))
    assert await streamed(http, hal0d, "chat") == 200
    load_s = (await views(http, hal0d))["a"]["load_s"]
    with capture_logs() as logs:
        began = time.monotonic()
        assert await streamed(http, hal0d, "think-only") == 200
        took_s = time.monotonic() - began
    assert took_s < 4 * load_s, (took_s, load_s)  # an unload and a load, no turn waited out
    [evicting] = [e for e in logs if e["event"] == "slot.evicting"]
    assert "a has nothing queued or in flight" in evicting["why"]


async def test_a_turn_that_is_over_never_cuts_the_request_in_flight(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """a's turn (one load, max_wait_s 0.2) ends while its 3 s stream runs: the stream ends
    whole, and b loads only after it."""
    tmp_path.mkdir(exist_ok=True)
    slots = [on_demand("a", tmp_path, "--startup-delay", LOAD_S, "--delay", "0.02",
                       group="gpu0", models=("reasoning",)),
             on_demand("b", tmp_path, "--startup-delay", LOAD_S, group="gpu0")]
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *slots, groups=swap_group("batch", 0.2, min_turn_loads=1.0)))
    assert await streamed(http, hal0d, "reasoning") == 200
    long = body("reasoning", "long", stream=True, max_tokens=150)
    with capture_logs() as logs:
        async with http.post(hal0d.make_url(CHAT), json=long) as resp:
            assert resp.status == 200
            await resp.content.readany()
            for_b = asyncio.create_task(streamed(http, hal0d, "think-only"))
            whole = await resp.read()
            told_by_its_end = [e["event"] for e in logs]
        assert whole.endswith(b"data: [DONE]\n\n"), whole[-200:]
        assert await for_b == 200
    # a's turn ended and its unload began with the stream in flight; b loaded only after.
    assert "slot.evicting" in told_by_its_end and "slot.draining" in told_by_its_end
    assert not any(e["event"] == "slot.loaded" for e in logs[:len(told_by_its_end)])
    assert any(e["event"] == "slot.loaded" and e["slot"] == "b" for e in logs)
