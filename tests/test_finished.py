"""What a finished request leaves (finished.py): its request.done line and its record, made in a
batch just after the answer, seen at once by every reader of history and metrics, never lost to
one request's failure, and flushed when hal0d stops."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
from structlog.testing import capture_logs

from hal0d.appkeys import FINISHER, RECORDER
from hal0d.finished import DELAY_S, MAX_WAIT_S, Finisher
from hal0d.metrics.recorder import Recorder
from hal0d.requestinfo import RequestInfo
from tests.conftest import ServerFactory, Stub, chat_body, eventually

LONG_DELAY_S = 3600.0  # a batch that would wait an hour: only a flush can have made the record


async def chat(http: aiohttp.ClientSession, url: Any, request_id: str) -> None:
    async with http.post(url, json=chat_body("chat", stream=False),
                         headers={"X-Request-Id": request_id}) as response:
        assert response.status == 200
        await response.read()


async def test_every_finished_request_gets_its_line_in_the_order_the_requests_ended(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    finisher = hal0d.app[FINISHER]

    def logged() -> list[str]:
        return [e["request_id"] for e in events if e["event"] == "request.done"]

    with capture_logs() as events:
        for n in range(5):
            await chat(http, hal0d.make_url("/v1/chat/completions"), f"batch-{n}")
        await eventually(lambda: len(logged()) >= 5, 2.0, "five request.done lines")
    assert logged() == [f"batch-{n}" for n in range(5)]  # in the order the requests ended
    assert finisher.pending == 0


async def test_every_reader_sees_the_requests_that_ended_before_it_asked(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    hal0d.app[FINISHER].delay_s = LONG_DELAY_S
    await chat(http, hal0d.make_url("/v1/chat/completions"), "seen-at-once")
    assert hal0d.app[FINISHER].pending == 1  # nothing made it yet: the batch waits

    async with http.get(hal0d.make_url("/api/requests")) as response:
        rows = (await response.json())["requests"]
    assert [row["request_id"] for row in rows] == ["seen-at-once"]

    await chat(http, hal0d.make_url("/v1/chat/completions"), "counted-at-once")
    async with http.get(hal0d.make_url("/metrics")) as response:
        text = await response.text()
    [line] = [line for line in text.splitlines()
              if line.startswith("hal0d_requests_total{") and 'endpoint="/v1/chat/completions"'
              in line]
    assert line.endswith(" 2.0"), line

    await chat(http, hal0d.make_url("/v1/chat/completions"), "in-the-status")
    async with http.get(hal0d.make_url("/api/status")) as response:
        status = await response.json()
    assert status["requests"] == 3, status

    await chat(http, hal0d.make_url("/v1/chat/completions"), "in-the-slot-metrics")
    async with http.get(hal0d.make_url("/api/slots/metrics")) as response:
        [slot] = (await response.json())["slots"]
    assert slot["requests"] == 4, slot


async def test_one_requests_failure_costs_only_its_own_line_and_record(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    recorder: Recorder = hal0d.app[RECORDER]
    hal0d.app[FINISHER].delay_s = LONG_DELAY_S
    record = recorder.record

    def record_but_the_broken_one(info: Any) -> None:
        if info.request_id == "broken-record":
            raise RuntimeError("a broken disk, say")
        record(info)

    recorder.record = record_but_the_broken_one  # type: ignore[method-assign]
    with capture_logs() as events:
        for request_id in ("before", "broken-record", "after"):
            await chat(http, hal0d.make_url("/v1/chat/completions"), request_id)
        hal0d.app[FINISHER].flush()
    failed = [e for e in events if e["event"] == "request.finish_failed"]
    assert [e["request_id"] for e in failed] == ["broken-record"]
    lines = [e["request_id"] for e in events if e["event"] == "request.done"]
    assert lines == ["before", "after"]
    async with http.get(hal0d.make_url("/api/requests")) as response:
        rows = (await response.json())["requests"]
    assert sorted(row["request_id"] for row in rows) == ["after", "before"]


async def test_stopping_makes_the_last_records_before_the_history_closes(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    hal0d.app[FINISHER].delay_s = LONG_DELAY_S
    history = hal0d.app[RECORDER].history
    await chat(http, hal0d.make_url("/v1/chat/completions"), "the-last-one")
    assert history.written == 0
    await hal0d.close()
    assert history.written == 1


async def test_a_stream_being_served_delays_the_batch_by_a_bounded_time_only(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """The batch waits while requests are being served, up to MAX_WAIT_S: a stream held open
    (the stub's `stall` model sends a little and then nothing) does not hold the lines back."""
    hal0d = await start_hal0d(stub.url)
    finisher = hal0d.app[FINISHER]
    with capture_logs() as events:
        async with http.post(hal0d.make_url("/v1/chat/completions"),
                             json=chat_body("stall")) as stream:
            assert stream.status == 200
            await stream.content.readany()  # the stream is open and being served
            assert finisher.active == 1
            started = asyncio.get_running_loop().time()
            await chat(http, hal0d.make_url("/v1/chat/completions"), "beside-a-stream")
            await eventually(
                lambda: any(e.get("request_id") == "beside-a-stream" for e in events
                            if e["event"] == "request.done"),
                2.0, "the line of the request beside the stream",
            )
            waited = asyncio.get_running_loop().time() - started
            assert finisher.active == 1  # the stream was still being served all along
    assert waited < DELAY_S + MAX_WAIT_S + 0.5, waited


class Rows:
    """Takes the records a Finisher makes (the recorder's place)."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def record(self, info: Any) -> None:
        self.ids.append(info.request_id)


async def test_an_overdue_batch_is_made_whole_even_while_requests_are_served() -> None:
    """Requests always being served: once the oldest waited MAX_WAIT_S, the whole batch is made
    in one turn, so a Finisher keeps up with requests that end faster than one a turn."""
    finisher = Finisher(delay_s=0.0)
    rows = Rows()
    finisher.recorder = rows  # type: ignore[assignment]
    finisher.begin()  # a stream, served all along
    long_ago = time.monotonic() - MAX_WAIT_S - 1.0
    for n in range(50):
        finisher.begin()
        info = RequestInfo(request_id=f"r{n}", endpoint="/v1/embeddings")
        info.ended = long_ago
        finisher.add(info, "POST", "/v1/embeddings")
    assert finisher.active == 1 and finisher.pending == 50
    for _ in range(3):  # the timer's turn (and not the 50 turns a slice each would take)
        await asyncio.sleep(0)
    assert rows.ids == [f"r{n}" for n in range(50)]
    assert finisher.pending == 0


async def test_a_fresh_batch_waits_while_a_request_is_served_and_is_made_once_none_is() -> None:
    finisher = Finisher(delay_s=0.0)
    rows = Rows()
    finisher.recorder = rows  # type: ignore[assignment]
    finisher.begin()  # being served
    for n in range(3):
        finisher.begin()
        info = RequestInfo(request_id=f"r{n}", endpoint="/v1/embeddings")
        info.end()
        finisher.add(info, "POST", "/v1/embeddings")
    await asyncio.sleep(0.02)
    assert rows.ids == []  # nothing made while the request is served (and not overdue)
    served = RequestInfo(request_id="served", endpoint="/v1/embeddings")
    served.end()
    finisher.add(served, "POST", "/v1/embeddings")  # the served request ends: nothing is served
    await eventually(lambda: len(rows.ids) == 4, 1.0, "the batch made once nothing is served")
    assert rows.ids[:3] == ["r0", "r1", "r2"]
