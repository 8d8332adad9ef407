"""Swaps that do not thrash, over real sockets with the stub as each slot's command: a group of
`max_loaded = 1` under `policy = "batch"` serves a loaded model's burst before it swaps, under
`"fifo"` it swaps for every request of the other model. `max_wait_s`, when set, ends a turn early
for a request that waited that long; a model with nothing queued is swapped out at once; a load
whose requests left while it waited is withdrawn. A swap that waits shows in /api/slots, on
/api/events, in /metrics and in the history's turn_ms. How long a busy model's turn is (priced by
what a swap costs) is tested in test_swap_turns.py."""

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

from tests.harness.client import Reader, chat, views
from tests.harness.config import build_config
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.processes import alive, stub_pids
from tests.harness.swaps import LONG_TURN_LOADS, PidLog, streamed, swap_group, two_models

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone


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
