"""GET /api/timeline: the history's per-minute figures (through the real HistoryWriter and its
SQLite file), the lifecycle's last hour (real loads, swaps, a failed load and unloads of stub
processes), and each group's memory."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest

from hal0d.config import GroupConfig
from hal0d.lifecycle.room import Swap
from hal0d.lifecycle.slots import SlotState
from hal0d.lifecycle.vocabulary import LoadPhase, SwapPhase, UnloadReason
from hal0d.observability.history import HistoryWriter, RequestRecord, percentile
from hal0d.observability.timeline import LifecycleLog
from tests.harness.client import chat, state_is
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, launch, start, stop
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import kill_with_its_group, stub_pids
from tests.harness.stubs import stub_command


def row(ts: float, slot: str, *, ok: bool = True, ttft_ms: float | None = None,
        total_ms: float | None = None, completion_tokens: int | None = None,
        queue_ms: float | None = 0.0) -> RequestRecord:
    return RequestRecord(ts=ts, request_id=f"r{ts}", slot=slot, model="chat",
                         endpoint="/v1/chat/completions", stream=ttft_ms is not None,
                         status=200 if ok else 502, ok=ok,
                         error_code=None if ok else "dispatch.upstream_unavailable",
                         queue_ms=queue_ms, ttft_ms=ttft_ms, total_ms=total_ms,
                         completion_tokens=completion_tokens)


def test_the_nearest_rank_percentile_is_always_a_measured_value() -> None:
    values = [float(v) for v in range(1, 21)]
    assert percentile(values, 50) == 10.0
    assert percentile(values, 95) == 19.0
    assert percentile([7.0], 95) == 7.0
    assert percentile([], 50) is None


async def test_minutes_count_ok_and_errors_and_take_percentiles_per_slot_and_minute(
    writer: HistoryWriter
) -> None:
    minute = (time.time() // 60 - 30) * 60  # half an hour ago, on a minute's start
    # Ten streams in one minute: TTFT 10..100 ms, 100 tokens over (1000 - TTFT) ms, queue i ms.
    for i in range(1, 11):
        writer.submit(row(minute + i, "a", ttft_ms=10.0 * i, total_ms=1000.0 + 10.0 * i,
                          completion_tokens=100 * i, queue_ms=float(i)))
    writer.submit(row(minute + 30, "a", ok=False, queue_ms=None))
    writer.submit(row(minute + 61, "a", total_ms=50.0, completion_tokens=5))  # whole: no speed
    writer.submit(row(minute + 5, "b", ttft_ms=20.0, total_ms=220.0, completion_tokens=10))
    writer.submit(row(minute - 7200, "a"))  # before `since`
    await writer.flush()

    got = await writer.minutes(minute - 60)
    assert [(m["ts"], m["slot"], m["requests"], m["ok"], m["errors"]) for m in got] == [
        (minute, "a", 11, 10, 1), (minute, "b", 1, 1, 0), (minute + 60, "a", 1, 1, 0)]
    first = got[0]
    assert first["ttft_ms"] == {"p50": 50.0, "p95": 100.0}
    assert first["tokens_per_s"] == {"p50": 500.0, "p95": 1000.0}  # 100*i tokens in 1 s each
    assert first["queue_ms"] == {"p50": 5.0, "p95": 10.0}
    assert got[1]["tokens_per_s"] == {"p50": 50.0, "p95": 50.0}
    assert got[2]["tokens_per_s"] == {"p50": None, "p95": None}
    assert got[2]["ttft_ms"] == {"p50": None, "p95": None}


async def test_recent_rows_between_since_and_until_are_that_minutes_requests(
    writer: HistoryWriter
) -> None:
    minute = (time.time() // 60 - 10) * 60
    for offset in (-1, 0, 30, 59.9, 60):
        writer.submit(row(minute + offset, "a"))
    await writer.flush()
    rows = await writer.recent(100, since=minute, until=minute + 60)
    assert [r["ts"] - minute for r in rows] == pytest.approx([59.9, 30, 0])


def test_the_log_keeps_an_hour_infers_what_began_before_it_and_records_swap_steps() -> None:
    now = [10_000.0]
    log = LifecycleLog(keep_s=3600, clock=lambda: now[0])
    now[0] += 4000  # the log has run longer than an hour
    log.load_phase("a", LoadPhase.STARTING, 0.0, None)
    now[0] += 1
    log.load_phase("a", LoadPhase.PROBING, 1.0, None)  # a later phase of the same load
    now[0] += 1
    log.load_phase("a", LoadPhase.READY, 2.0, None)
    now[0] += 100
    log.swap(Swap(group="gpu", phase=SwapPhase.PLANNED, slot="b", victim="a", waited_s=0.0,
                  why="max_loaded = 1", policy="batch", max_wait_s=30.0))
    log.unloaded("a", UnloadReason.EVICTED, 100.0)
    now[0] += 10
    log.load_phase("b", LoadPhase.WAITING_FOR_ROOM, 0.0, None)
    log.load_phase("b", LoadPhase.FAILED, 0.5, "exit code 1")
    kinds = [(e["slot"], e["kind"], e.get("reason")) for e in log.events(0)]
    assert kinds == [("a", "load", None), ("a", "loaded", None), ("b", "swap", "max_loaded = 1"),
                     ("a", "unload", "evicted"), ("b", "load", None),
                     ("b", "load_failed", "exit code 1")]
    start = now[0] - 112
    spans = log.spans(0, {"a": None, "b": None, "c": "loaded"})
    assert [(s.slot, s.state, s.start - start, None if s.end is None else s.end - start,
             s.outcome) for s in spans] == [
        ("a", "loading", 0, 2, "loaded"), ("a", "loaded", 2, 102, None),
        ("b", "loading", 112, 112, "failed"),
        ("c", "loaded", now[0] - 3600 - start, None, None),  # loaded all the hour it kept
    ]
    now[0] += 3545  # a's load falls out of the hour, its unload does not: loaded before it
    assert [e["kind"] for e in log.events(0)] == ["swap", "unload", "load", "load_failed"]
    assert [(s.start - start, None if s.end is None else s.end - start)
            for s in log.spans(0, {"a": None}) if s.slot == "a"] == [(57, 102)]
    assert [e["kind"] for e in log.events(now[0] - 60)] == []


def test_a_slot_in_error_has_error_spans_until_it_answers_and_the_hour_infers_one_begun_before(
) -> None:
    now = [10_000.0]
    log = LifecycleLog(keep_s=3600, clock=lambda: now[0])
    gone: Any = SimpleNamespace(name="gone")  # a slot without a command: probes only
    log.state_changed(gone, SlotState.OFFLINE, SlotState.ERROR, "cannot connect")
    now[0] += 10
    log.state_changed(gone, SlotState.ERROR, SlotState.READY, None)
    now[0] += 10
    log.state_changed(gone, SlotState.READY, SlotState.ERROR, "probe failed")
    log.state_changed(gone, SlotState.ERROR, SlotState.ERROR, "still failing")  # no news
    assert [(e["kind"], e.get("old")) for e in log.events(0)] == [
        ("error", "offline"), ("recovered", None), ("error", "ready")]
    spans = [(s.state, s.start - 10_000, None if s.end is None else s.end - 10_000)
             for s in log.spans(0, {"gone": "error"})]
    assert spans == [("error", 0, 10), ("loaded", 10, 20), ("error", 20, None)]
    now[0] += 3595  # out of the hour but the last error, which says what it left: loaded
    assert [s.state for s in log.spans(0, {"gone": "error"})] == ["loaded", "error"]
    now[0] += 3600  # nothing kept: the slot's state now says it
    assert [(s.state, s.end) for s in log.spans(0, {"gone": "error"})] == [("error", None)]


async def timeline(http: aiohttp.ClientSession, url: Any, query: str = "") -> dict[str, Any]:
    async with http.get(url.with_path("/api/timeline").with_query(query)) as resp:
        assert resp.status == 200, await resp.text()
        answer: dict[str, Any] = await resp.json()
        return answer


async def test_the_timeline_shows_two_swaps_a_failed_load_and_the_api_unload_with_reasons(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1, memory_mib=24000,
                                 free_memory_command=("echo", "20480"))}
    slots = [on_demand("a", tmp_path, group="gpu0", memory_mib=9000),
             on_demand("b", tmp_path, group="gpu0", memory_mib=12000),
             on_demand("c", tmp_path, "--fail-start", "error: out of memory")]
    hal0d = await start(start_hal0d, build_config(tmp_path, *slots, groups=group))
    began = time.time()
    for model in ("chat", "think-only", "chat"):  # a, then b (a evicted), then a (b evicted)
        status, answer = await chat(http, hal0d, model)
        assert status == 200, answer
    assert (await chat(http, hal0d, "tool"))[0] == 503  # c's load fails
    async with http.post(hal0d.make_url("/api/slots/a/unload")) as resp:
        assert resp.status == 200
    await state_is(http, hal0d, "a", "stopped")

    got = await timeline(http, hal0d.make_url("/"))
    assert got["bucket_s"] == 60 and got["since"] == pytest.approx(got["now"] - 3600, abs=1)
    marks = [(e["slot"], e["kind"], e.get("reason")) for e in got["events"]
             if e["kind"] not in ("load", "swap")]
    # The two swaps' steps, told by the waiting model: b (a makes room), then a (b does).
    swaps = [(e["slot"], e["phase"]) for e in got["events"] if e["kind"] == "swap"]
    assert [slot for slot, phase in swaps if phase == "done"] == ["b", "a"], swaps
    assert marks == [("a", "loaded", None), ("a", "unload", "evicted"), ("b", "loaded", None),
                     ("b", "unload", "evicted"), ("a", "loaded", None),
                     ("c", "load_failed", marks[5][2]), ("a", "unload", "api")]
    assert "out of memory" in marks[5][2]
    assert all(e["ts"] >= began - 1 for e in got["events"])
    loaded = [(s["slot"], s["to"] is None) for s in got["spans"] if s["state"] == "loaded"]
    assert loaded == [("a", False), ("a", False), ("b", False)]
    failed = [s for s in got["spans"] if s["outcome"] == "failed"]
    assert [s["slot"] for s in failed] == ["c"]
    assert sum(m["errors"] for m in got["minutes"] if m["slot"] == "c") == 1
    assert sum(m["requests"] for m in got["minutes"]) == 4
    assert got["groups"] == [{
        "name": "gpu0", "memory_mib": 24000, "max_loaded": 1, "members": ["a", "b"],
        "loaded": [], "used_mib": 0, "free_mib": 20480,
        "free_at": got["groups"][0]["free_at"]}]

    # Loaded now: in the group's memory; `since` narrows everything to what came after it.
    assert (await chat(http, hal0d, "think-only"))[0] == 200
    later = await timeline(http, hal0d.make_url("/"), f"since={time.time() - 5}")
    assert later["groups"][0]["loaded"] == [{"slot": "b", "memory_mib": 12000}]
    assert later["groups"][0]["used_mib"] == 12000
    assert [s["slot"] for s in later["spans"] if s["to"] is None] == ["b"]
    assert all(e["ts"] >= later["since"] for e in later["events"])


async def test_since_must_be_a_unix_time(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(tmp_path, on_demand("a", tmp_path)))
    for bad in ("yesterday", "nan", "inf"):
        async with http.get(hal0d.make_url("/api/timeline").with_query(since=bad)) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["param"] == "since"
    got = await timeline(http, hal0d.make_url("/"), "since=0")  # a day at most
    assert got["since"] == pytest.approx(got["now"] - 86400, abs=1)


async def test_the_last_hour_survives_a_restart_and_a_crash_marks_what_was_left_loaded(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Two real `hal0d serve` runs on one history. The first loads and unloads an on-demand slot
    through the API, then dies by SIGKILL with its `always` slot loaded; the second's
    /api/timeline has the first run's events, the always slot marked stopped at the restart, and
    its own load after."""

    always_port, demand_port = free_port(), free_port()
    slots = f"""
        [[slots]]
        name = "always"
        upstream = "http://127.0.0.1:{always_port}"
        models = ["chat"]
        command = {orjson.dumps(list(stub_command(always_port, tmp_path / "a.log"))).decode()}

        [[slots]]
        name = "demand"
        upstream = "http://127.0.0.1:{demand_port}"
        models = ["tool"]
        command = {orjson.dumps(list(stub_command(demand_port, tmp_path / "d.log"))).decode()}
        start = "on_demand"
    """

    async def ready(base: str, name: str) -> bool:
        async with http.get(f"{base}/api/slots") as resp:
            return any(v["name"] == name and v["state"] == "ready"
                       for v in (await resp.json())["slots"])

    first = await launch(tmp_path, "http://unused", slot=slots)
    try:
        await eventually(lambda: ready(first.url, "always"), 20, "the always slot ready")
        for action in ("load", "unload"):
            async with http.post(f"{first.url}/api/slots/demand/{action}") as resp:
                assert resp.status == 200, await resp.text()
        async with http.get(f"{first.url}/api/requests") as resp:
            assert resp.status == 200  # the history writer has written what it was given
    finally:
        kill_with_its_group(first.process.pid)
        await first.process.wait()
        for pid in stub_pids(str(tmp_path)):
            kill_with_its_group(pid)  # the killed hal0d's slot process, orphaned
    await eventually(lambda: not stub_pids(str(tmp_path)), 5, "the orphaned stub gone")

    second = await launch(tmp_path, "http://unused", slot=slots)
    try:
        await eventually(lambda: ready(second.url, "always"), 20, "the always slot ready again")
        async with http.get(f"{second.url}/api/timeline") as resp:
            got = await resp.json()
    finally:
        await stop(second.process)
    marks = [(e["slot"], e["kind"], e.get("reason")) for e in got["events"]]
    restarted = marks.index(("always", "stopped", "hal0d restarted"))
    before, after = marks[:restarted], marks[restarted + 1:]
    assert ("always", "loaded", None) in before
    assert [m for m in before if m[0] == "demand" and m[1] != "load"] == [
        ("demand", "loaded", None), ("demand", "unload", "api")]
    assert ("always", "loaded", None) in after  # the second run's own load
    assert ("demand", "stopped", "hal0d restarted") not in marks  # it was unloaded before
    spans = [(s["slot"], s["state"], s["to"] is None) for s in got["spans"]]
    assert spans.count(("always", "loaded", False)) == 1  # the first run's, closed at the restart
    assert ("always", "loaded", True) in spans  # the second run's, still open
