"""Swaps that do not thrash, over real sockets with the stub as each slot's command: a group of
`max_loaded = 1` under `policy = "batch"` serves a loaded model's burst before it swaps, under
`"fifo"` it swaps for every request of the other model. A busy model's turn is priced by what a
swap of its group measurably costs (slower loads, longer turns); `max_wait_s`, when set, ends a
turn early for a request that waited that long; a model with no work is swapped out at once.
Three busy models each get their turns, no request is refused while it waits for one, and none
waits past the bound /api/slots gives. A swap that waits shows in /api/slots, on /api/events, in
/metrics and in the history's turn_ms."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from hal0d.config import GroupConfig, SlotConfig
from tests.harness.client import CHAT, Reader, body, chat, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.processes import ProcessSampler, alive, stub_pids

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone

LOAD_S = "0.8"  # the stub's --startup-delay: a model that loads for 0.8 s


# A turn of 50 loads (40 s here): what ends it in a test of max_wait_s is that bound.
LONG_TURN_LOADS = 50.0


def swap_group(policy: str, max_wait_s: float | None = None, min_turn_loads: float = 3.0,
               max_swap_share: float = 0.2) -> dict[str, GroupConfig]:
    """A group of max_loaded = 1, its turns priced as by default unless a test says."""
    return {"gpu0": GroupConfig("gpu0", max_loaded=1, policy=policy, max_wait_s=max_wait_s,
                                min_turn_loads=min_turn_loads, max_swap_share=max_swap_share)}


def two_models(where: Path, **keys: Any) -> list[SlotConfig]:
    where.mkdir(exist_ok=True)
    return [on_demand(name, where, "--startup-delay", LOAD_S, group="gpu0", **keys)
            for name in ("a", "b")]


class PidLog(ProcessSampler):
    """The sampler of tests/test_loader.py, also keeping every pid it saw alive: one per
    process the group started, that is one per load."""

    def __init__(self, marker: str) -> None:
        super().__init__(marker)
        self.pids: set[int] = set()

    def run(self) -> None:
        while not self._done.wait(0.01):
            living = stub_pids(self.marker)
            self.pids |= living
            self.most_alive = max(self.most_alive, len(living))
            self.samples += 1


async def streamed(http: aiohttp.ClientSession, hal0d: TestServer, model: str,
                   text: str = "hi") -> int:
    async with http.post(hal0d.make_url(CHAT), json=body(model, text, stream=True)) as resp:
        whole = await resp.read()
        assert resp.status != 200 or whole.endswith(b"data: [DONE]\n\n"), whole[-200:]
        return resp.status


async def closed_loop(http: aiohttp.ClientSession, hal0d: TestServer, seconds: float,
                      clients_per_model: int = 3) -> list[int]:
    """Clients per model, each sending a short streamed request as soon as its last ended."""
    statuses: list[int] = []
    until = time.monotonic() + seconds

    async def client(model: str) -> None:
        while time.monotonic() < until:
            statuses.append(await streamed(http, hal0d, model))

    await asyncio.gather(*(client(model) for model in ("chat", "think-only")
                           for _ in range(clients_per_model)))
    return statuses


async def test_the_closed_loop_makes_at_most_half_the_loads_under_batch_that_fifo_makes(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Two hal0d side by side, one per policy, each with two models loading for 0.8 s in one
    group of max_loaded = 1 and three clients per model: every request is answered, never are
    two processes of a group alive, and batch loads at most half as often (fifo swaps for about
    every third request; batch serves a model's stream for its turn, about 4 s here)."""
    runs: dict[str, tuple[TestServer, PidLog]] = {}
    for policy in ("fifo", "batch"):
        where = tmp_path / policy
        hal0d = await start(start_hal0d, build_config(
            where, *two_models(where), groups=swap_group(policy)))
        runs[policy] = (hal0d, PidLog(str(where)))
    for _, sampler in runs.values():
        sampler.start()
    try:
        results = await asyncio.gather(*(closed_loop(http, hal0d, 10.0)
                                         for hal0d, _ in runs.values()))
    finally:
        for _, sampler in runs.values():
            sampler.__exit__()
    loads = {policy: len(sampler.pids) for policy, (_, sampler) in runs.items()}
    answered = {policy: len(statuses) for policy, statuses in zip(runs, results, strict=True)}
    print(f"\nclosed loop, 10 s: loads {loads}, answered {answered}")
    for statuses in results:
        assert statuses and set(statuses) == {200}
    for _, sampler in runs.values():
        assert sampler.samples > 100 and sampler.most_alive == 1
    assert loads["batch"] * 2 <= loads["fifo"], loads


async def test_max_wait_s_ends_a_long_turn_for_a_request_that_waited_that_long(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A keeps serving its stream while B waits, though its turn (50 loads) is far from over:
    B is answered within max_wait_s, one load and its own time (measured alone first), plus
    A's last requests draining and its process stopping."""
    max_wait_s = 1.5
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", max_wait_s, min_turn_loads=LONG_TURN_LOADS)))
    began = time.monotonic()
    assert await streamed(http, hal0d, "think-only") == 200
    load_and_own_s = time.monotonic() - began  # b's load and its own time, alone
    assert await streamed(http, hal0d, "chat") == 200  # b has no work: swapped at once
    stop = asyncio.Event()
    served_a = 0

    async def stream_for_a() -> None:
        nonlocal served_a
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200
            served_a += 1

    with capture_logs() as logs:
        streams = [asyncio.create_task(stream_for_a()) for _ in range(3)]
        await asyncio.sleep(0.2)
        asked = time.monotonic()
        assert await streamed(http, hal0d, "think-only") == 200
        waited_s = time.monotonic() - asked
        stop.set()
        await asyncio.gather(*streams)
    print(f"\nb alone {load_and_own_s:.2f} s; b in a's stream {waited_s:.2f} s, "
          f"{served_a} served for a")
    assert max_wait_s <= waited_s <= max_wait_s + load_and_own_s + 0.75
    swaps = [(e["event"], e["slot"], e["victim"]) for e in logs if e["event"].startswith("swap.")]
    assert swaps[:3] == [("swap.planned", "b", "a"), ("swap.started", "b", "a"),
                         ("swap.done", "b", "a")], swaps
    [started] = [e for e in logs if e["event"] == "swap.started" and e["slot"] == "b"][:1]
    assert started["waited_s"] >= max_wait_s and "waited max_wait_s" in started["why"]


async def test_a_model_with_nothing_queued_is_swapped_out_at_once(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    max_wait_s = 20.0
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", max_wait_s, min_turn_loads=LONG_TURN_LOADS)))
    assert await streamed(http, hal0d, "chat") == 200
    pid = next(iter(stub_pids(str(tmp_path))))
    with capture_logs() as logs:
        began = time.monotonic()
        status, _ = await chat(http, hal0d, "think-only")
        took_s = time.monotonic() - began
    assert status == 200
    assert not alive(pid)
    assert took_s < max_wait_s / 4, took_s  # one unload and one load, no wait for a turn
    [evicting] = [e for e in logs if e["event"] == "slot.evicting"]
    assert evicting["slot"] == "a" and "a has nothing queued or in flight" in evicting["why"]
    assert [e["event"] for e in logs if e["event"].startswith("swap.")] == [
        "swap.planned", "swap.started", "swap.done"]


async def test_a_waiting_swap_shows_in_api_slots_the_event_feed_the_metrics_and_the_history(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    max_wait_s = 1.5
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", max_wait_s, min_turn_loads=LONG_TURN_LOADS)))
    assert await streamed(http, hal0d, "chat") == 200
    reader = Reader(http, hal0d)
    await reader.wait_for("hello", "the feed's hello")
    stop = asyncio.Event()

    async def stream_for_a() -> None:
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200

    streams = [asyncio.create_task(stream_for_a()) for _ in range(2)]
    await asyncio.sleep(0.2)
    for_b = asyncio.create_task(streamed(http, hal0d, "think-only"))

    async def pending() -> dict[str, Any] | None:
        return (await views(http, hal0d))["b"]["pending_swap"]

    async def seen() -> bool:
        return await pending() is not None

    await eventually(seen, 5, "b's pending swap in /api/slots")
    await asyncio.sleep(0.6)
    swap = await pending()
    assert swap is not None
    assert (swap["waiting"], swap["victim"], swap["max_wait_s"]) == ("b", "a", max_wait_s)
    assert re.fullmatch(r"waiting for b's turn: [01] s of 1\.5", swap["why"]), swap
    both = await views(http, hal0d)
    assert both["a"]["pending_swap"] == swap or both["a"]["pending_swap"]["waiting"] == "b"
    assert (both["b"]["group_policy"], both["b"]["group_max_wait_s"]) == ("batch", max_wait_s)
    assert await for_b == 200
    stop.set()
    await asyncio.gather(*streams)
    assert (await views(http, hal0d))["b"]["pending_swap"] is None

    await reader.wait_for("swap", "b's swap done", slot="b", phase="done")
    steps = [(e["phase"], e["victim"]) for e in reader.named("swap") if e["slot"] == "b"]
    assert steps[:3] == [("planned", "a"), ("started", "a"), ("done", "a")], steps
    started = next(e for e in reader.named("swap") if e["slot"] == "b"
                   and e["phase"] == "started")
    assert started["waited_s"] >= max_wait_s and started["group"] == "gpu0"
    assert started["policy"] == "batch" and "waited max_wait_s" in started["why"]

    async with http.get(hal0d.make_url("/metrics")) as resp:
        metrics = {(s.name, s.labels.get("group")): s.value
                   for family in text_string_to_metric_families(await resp.text())
                   for s in family.samples}
    swaps = metrics[("hal0d_group_swaps_total", "gpu0")]
    assert swaps >= 1
    assert metrics[("hal0d_group_turn_wait_seconds_count", "gpu0")] == swaps
    assert metrics[("hal0d_group_turn_wait_seconds_sum", "gpu0")] >= max_wait_s

    async with http.get(hal0d.make_url("/api/requests?limit=50")) as resp:
        rows = (await resp.json())["requests"]
    [row] = [r for r in rows if r["model"] == "think-only"]
    assert row["turn_ms"] >= max_wait_s * 1000 * 0.9, row
    assert row["turn_ms"] <= row["load_ms"] <= row["queue_ms"], row
    assert all(r["turn_ms"] == 0 for r in rows if r["model"] == "chat" and not r["load_ms"])


async def test_a_load_whose_requests_left_while_it_waited_is_withdrawn_and_unloads_nothing(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", min_turn_loads=LONG_TURN_LOADS)))
    assert await streamed(http, hal0d, "chat") == 200
    [pid_a] = stub_pids(str(tmp_path))
    stop = asyncio.Event()

    async def stream_for_a() -> None:
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200

    with capture_logs() as logs:
        streams = [asyncio.create_task(stream_for_a()) for _ in range(2)]
        await asyncio.sleep(0.2)
        leaving = asyncio.create_task(streamed(http, hal0d, "think-only"))

        async def b_waits() -> bool:
            return (await views(http, hal0d))["b"]["pending_swap"] is not None

        await eventually(b_waits, 5, "b waiting for its turn")
        leaving.cancel()  # its client leaves while b's load waits for a's batch to end

        async def b_at_rest() -> bool:
            return any(e["event"] == "slot.load_withdrawn" for e in logs)

        await eventually(b_at_rest, 5, "b's load withdrawn")
        stop.set()
        await asyncio.gather(*streams)
    assert stub_pids(str(tmp_path)) == {pid_a}  # a kept its process; b never started one
    events = [e["event"] for e in logs]
    assert "slot.evicting" not in events and "swap.started" not in events
    b = (await views(http, hal0d))["b"]
    assert (b["state"], b["queued"], b["pending_swap"]) == ("stopped", 0, None)
    assert await streamed(http, hal0d, "think-only") == 200  # a later request loads it


async def test_a_load_through_the_api_waits_for_no_batch(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path),
        groups=swap_group("batch", min_turn_loads=LONG_TURN_LOADS)))
    assert await streamed(http, hal0d, "chat") == 200
    stop = asyncio.Event()

    async def stream_for_a() -> None:
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200

    streams = [asyncio.create_task(stream_for_a()) for _ in range(2)]
    await asyncio.sleep(0.2)
    began = time.monotonic()
    async with http.post(hal0d.make_url("/api/slots/b/load")) as resp:
        assert resp.status == 200 and (await resp.json())["state"] == "ready"
    took_s = time.monotonic() - began
    stop.set()
    await asyncio.gather(*streams)
    assert took_s < 10, took_s  # a's turn of 50 loads would have held it for 40 s


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
