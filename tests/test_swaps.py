"""Swaps that do not thrash, over real sockets with the stub as each slot's command: a group of
`max_loaded = 1` under `policy = "batch"` serves a loaded model's burst before it swaps, under
`"fifo"` it swaps for every request of the other model; a request for the other model still
gets its turn within `max_wait_s`, and a model with no work is swapped out at once. A swap
that waits shows in /api/slots, on /api/events, in /metrics and in the history's turn_ms.
With `min_turn_loads`, a busy model's turn lasts that many of its own measured loads: three
models whose loads outlast `max_wait_s` still batch, within the wait bound /api/slots shows."""

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

LOAD_S = "0.8"  # the stub's --startup-delay: a model that loads for 0.8 s


def swap_group(policy: str, max_wait_s: float = 30.0,
               min_turn_loads: float = 0.0) -> dict[str, GroupConfig]:
    """A group of max_loaded = 1; by default max_wait_s alone ends a turn (min_turn_loads = 0),
    the rule most tests here are about."""
    return {"gpu0": GroupConfig("gpu0", max_loaded=1, policy=policy, max_wait_s=max_wait_s,
                                min_turn_loads=min_turn_loads)}


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
    every third request; batch serves a model's stream for max_wait_s = 5 s)."""
    runs: dict[str, tuple[TestServer, PidLog]] = {}
    for policy in ("fifo", "batch"):
        where = tmp_path / policy
        hal0d = await start(start_hal0d, build_config(
            where, *two_models(where), groups=swap_group(policy, max_wait_s=5.0)))
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


async def test_one_request_for_b_in_a_constant_stream_for_a_is_answered_within_max_wait_s(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A keeps serving its stream while B waits, and B is answered within max_wait_s, one load
    and its own time (measured alone first), plus A's last requests draining and its process
    stopping."""
    max_wait_s = 1.5
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", max_wait_s)))
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
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", max_wait_s)))
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
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", max_wait_s)))
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
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", 30.0)))
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
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", 30.0)))
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
    assert took_s < 10, took_s  # a's batch would have held it for 30 s


# -- turns that pay for their load (min_turn_loads) -----------------------------------------------

THREE = {"a": "chat", "b": "think-only", "c": "tool"}


def three_models(where: Path) -> list[SlotConfig]:
    where.mkdir(exist_ok=True)
    return [on_demand(name, where, "--startup-delay", "1", group="gpu0") for name in THREE]


async def timed_loop(http: aiohttp.ClientSession, hal0d: TestServer, seconds: float,
                     clients_per_model: int = 3) -> list[tuple[int, float]]:
    """Closed-loop clients on the three models: each request's status and latency."""
    answers: list[tuple[int, float]] = []
    until = time.monotonic() + seconds

    async def client(model: str) -> None:
        while time.monotonic() < until:
            began = time.monotonic()
            status = await streamed(http, hal0d, model)
            answers.append((status, time.monotonic() - began))

    await asyncio.gather(*(client(model) for model in THREE.values()
                           for _ in range(clients_per_model)))
    return answers


async def test_three_models_whose_loads_outlast_max_wait_s_batch_with_turns_that_pay_for_them(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Three models loading for about 1 s, max_wait_s = 0.5 (below a load), three clients per
    model for 12 s, fifo and batch side by side: without a minimum turn every wait has passed
    max_wait_s by the time a load is done, and batch swaps as often as fifo; with
    min_turn_loads = 3 a turn pays for its load, so batch makes at most half fifo's loads.
    Every request is answered, none waits past the learned bound, never are two loaded."""
    runs: dict[str, tuple[TestServer, PidLog]] = {}
    for policy in ("fifo", "batch"):
        where = tmp_path / policy
        hal0d = await start(start_hal0d, build_config(
            where, *three_models(where),
            groups=swap_group(policy, max_wait_s=0.5, min_turn_loads=3.0)))
        runs[policy] = (hal0d, PidLog(str(where)))
    for _, sampler in runs.values():
        sampler.start()
    try:
        results = await asyncio.gather(*(timed_loop(http, hal0d, 12.0)
                                         for hal0d, _ in runs.values()))
    finally:
        for _, sampler in runs.values():
            sampler.__exit__()
    loads = {policy: len(sampler.pids) for policy, (_, sampler) in runs.items()}
    answered = {policy: len(answers) for policy, answers in zip(runs, results, strict=True)}
    batch = await views(http, runs["batch"][0])
    load_s = max(view["load_s"] for view in batch.values() if view["load_s"] is not None)
    bound_s = batch["a"]["turn_wait_s"]  # the learned wait for a turn, the same for all three
    slowest = max(latency for _, latency in results[1])
    print(f"\nthree models, 12 s: loads {loads}, answered {answered}; batch: slowest "
          f"{slowest:.2f} s, turn_wait_s {bound_s} s, load {load_s} s")
    for answers in results:
        assert answers and {status for status, _ in answers} == {200}
    for _, sampler in runs.values():
        assert sampler.samples > 100 and sampler.most_alive == 1
    assert loads["batch"] * 2 <= loads["fifo"], loads
    assert bound_s == pytest.approx(2 * (3 * load_s + load_s), abs=0.2)  # (n - 1)(turn + load)
    # The documented bound: the turns and loads of the two others, then its own load, plus
    # each of those three swaps' victim draining its requests (a few ms here) and its process
    # exiting, and the spread of loads that run beside the other hal0d's: 2 s in all.
    assert slowest <= bound_s + load_s + 2.0, (slowest, bound_s, load_s)


async def test_a_busy_model_keeps_its_turn_for_min_turn_loads_of_its_own_load(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """max_wait_s = 0.3 is long over when b's turn comes: a, busy, keeps the group until it
    has been loaded 3 times its measured load time; /api/slots shows the load time, when b's
    turn comes and the wait bound learned from the loads."""
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", 0.3, min_turn_loads=3.0)))
    assert await streamed(http, hal0d, "chat") == 200
    stop = asyncio.Event()

    async def stream_for_a() -> None:
        while not stop.is_set():
            assert await streamed(http, hal0d, "chat") == 200

    with capture_logs() as logs:
        streams = [asyncio.create_task(stream_for_a()) for _ in range(3)]
        a = (await views(http, hal0d))["a"]
        asked = time.monotonic()
        turn_left_s = 3 * a["load_s"] - a["loaded_for_s"]  # of a's turn, as b asks
        for_b = asyncio.create_task(streamed(http, hal0d, "think-only"))

        async def pending() -> dict[str, Any] | None:
            return (await views(http, hal0d))["b"]["pending_swap"]

        async def seen() -> bool:
            return await pending() is not None

        await eventually(seen, 5, "b's pending swap")
        swap = await pending()
        assert await for_b == 200
        waited_s = time.monotonic() - asked
        stop.set()
        await asyncio.gather(*streams)
    print(f"\na's load {a['load_s']} s, its turn left {turn_left_s:.2f} s; b waited "
          f"{waited_s:.2f} s; {swap}")
    assert turn_left_s > 1.0 and waited_s >= turn_left_s - 0.15, (turn_left_s, waited_s)
    assert swap is not None and swap["turn_at_s"] == pytest.approx(turn_left_s, abs=0.3)
    assert swap["max_wait_s"] == 0.3 and f"of {swap['turn_at_s']:g}" in swap["why"]
    [started] = [e for e in logs if e["event"] == "swap.started" and e["slot"] == "b"]
    assert "a's turn paid for its load (3 x" in started["why"], started
    # The bound as the loads measured by now say (a loaded again for its last streams).
    final = await views(http, hal0d)
    b = final["b"]
    loads = [final["a"]["load_s"], b["load_s"]]
    assert b["turn_wait_s"] == pytest.approx(3 * max(loads) + max(loads), abs=0.15), (b, loads)
    [loaded] = [e for e in logs if e["event"] == "slot.loaded" and e["slot"] == "b"]
    assert loaded["load_s"] == b["load_s"] and 0.8 <= loaded["measured_s"] < loaded["elapsed_s"]


async def test_a_model_with_no_work_is_swapped_out_at_once_whatever_its_minimum_turn(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """No minimum turn for nobody: a model with nothing queued or in flight goes as soon as
    another is asked for, though its turn of 50 loads is far from over."""
    hal0d = await start(start_hal0d, build_config(
        tmp_path, *two_models(tmp_path), groups=swap_group("batch", 0.3, min_turn_loads=50.0)))
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
