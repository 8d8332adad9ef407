"""What a finished request leaves: its request.done line and its record (the history row, the
metrics, the event feed), made where the request ends (app.py's lifecycle middleware): there when
its client has the answer, even while other requests are open (a status page's event feed), seen
by every reader of history and metrics, never lost to another request's failure, and in the
history when hal0d stops."""

from __future__ import annotations

import asyncio
import time
from io import StringIO
from typing import Any

import aiohttp
import orjson
from structlog.testing import capture_logs

from hal0d.appkeys import RECORDER
from hal0d.observability.recorder import Recorder
from tests.harness.client import chat_body
from tests.harness.daemons import ServerFactory
from tests.harness.logs import logs_into_buffer
from tests.harness.poll import eventually
from tests.harness.stubs import Stub

# "Within a few milliseconds of the client having its answer": a bound, not a benchmark. The
# old deferred finisher took the full 100 ms whenever an event reader was open.
PROMPTLY_S = 0.05
LOOK_EVERY_S = 0.001


async def chat(http: aiohttp.ClientSession, url: Any, request_id: str) -> None:
    async with http.post(url, json=chat_body("chat", stream=False),
                         headers={"X-Request-Id": request_id}) as response:
        assert response.status == 200
        await response.read()


def done_ids(buffer: StringIO) -> list[str]:
    """The request ids of the request.done lines in a JSON log."""
    return [event["request_id"] for event in map(orjson.loads, buffer.getvalue().splitlines())
            if event["event"] == "request.done"]


async def seen_within(found: Any, timeout: float) -> float:
    """How long after now `found()` first holds, asked every millisecond; fails past `timeout`."""
    started = time.monotonic()
    while not found():
        assert time.monotonic() - started < timeout, "not seen at all"
        await asyncio.sleep(LOOK_EVERY_S)
    return time.monotonic() - started


async def test_with_an_event_reader_open_the_line_and_row_are_there_when_the_client_has_its_answer(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    """An open GET /api/events (a status page) is a request being served all along; a request
    beside it has its line in the log and its row in the feed and the history at once."""
    hal0d = await start_hal0d(stub.url)
    feed_data = bytearray()

    async def read_feed(feed: aiohttp.ClientResponse) -> None:
        while chunk := await feed.content.readany():
            feed_data.extend(chunk)

    def in_feed() -> bool:
        return b'event: request\ndata: {' in feed_data and b'"beside-a-reader"' in feed_data

    with logs_into_buffer("json", "info") as buffer:
        async with http.get(hal0d.make_url("/api/events")) as feed:
            assert feed.status == 200
            reading = asyncio.create_task(read_feed(feed))
            await eventually(lambda: feed_data.startswith(b"event: hello"), 5.0, "the hello")
            await chat(http, hal0d.make_url("/v1/chat/completions"), "beside-a-reader")
            line_after = await seen_within(lambda: "beside-a-reader" in done_ids(buffer), 2.0)
            feed_after = await seen_within(in_feed, 2.0)
            async with http.get(hal0d.make_url("/api/requests")) as answer:
                rows = (await answer.json())["requests"]
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
    assert line_after < PROMPTLY_S, f"request.done {line_after * 1000:.1f} ms after the answer"
    assert feed_after < PROMPTLY_S, f"the feed's row {feed_after * 1000:.1f} ms after the answer"
    assert [row["request_id"] for row in rows] == ["beside-a-reader"]  # asked once, no retry


async def test_every_finished_request_gets_its_line_in_the_order_the_requests_ended(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    with capture_logs() as events:
        for n in range(5):
            await chat(http, hal0d.make_url("/v1/chat/completions"), f"one-by-one-{n}")
    logged = [e["request_id"] for e in events if e["event"] == "request.done"]
    assert logged == [f"one-by-one-{n}" for n in range(5)]  # each there when its answer was


async def test_every_reader_sees_the_requests_that_ended_before_it_asked(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    await chat(http, hal0d.make_url("/v1/chat/completions"), "seen-at-once")
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
    """A record that fails (a broken disk, say) is logged as request.finish_failed; that
    request's answer is whole, and the requests before and after it keep their line and row."""
    hal0d = await start_hal0d(stub.url)
    recorder: Recorder = hal0d.app[RECORDER]
    record = recorder.record

    def record_but_the_broken_one(info: Any, row: Any) -> None:
        if info.request_id == "broken-record":
            raise RuntimeError("a broken disk, say")
        record(info, row)

    recorder.record = record_but_the_broken_one  # type: ignore[method-assign]
    answers = []
    with capture_logs() as events:
        for request_id in ("before", "broken-record", "after"):
            async with http.post(hal0d.make_url("/v1/chat/completions"),
                                 json=chat_body("chat", stream=False),
                                 headers={"X-Request-Id": request_id}) as response:
                answers.append((response.status, await response.json()))
    assert [status for status, _ in answers] == [200, 200, 200]
    assert answers[1][1]["choices"] == answers[0][1]["choices"]  # the same whole answer
    failed = [e for e in events if e["event"] == "request.finish_failed"]
    assert [e["request_id"] for e in failed] == ["broken-record"]
    lines = [e["request_id"] for e in events if e["event"] == "request.done"]
    assert lines == ["before", "after"]
    async with http.get(hal0d.make_url("/api/requests")) as response:
        rows = (await response.json())["requests"]
    assert sorted(row["request_id"] for row in rows) == ["after", "before"]


async def test_stopping_writes_the_last_rows_before_the_history_closes(
    stub: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    history = hal0d.app[RECORDER].history
    history.linger_s = 3600.0  # the writer would hold the row an hour: only the close writes it
    await chat(http, hal0d.make_url("/v1/chat/completions"), "the-last-one")
    assert history.written == 0
    await hal0d.close()
    assert history.written == 1
