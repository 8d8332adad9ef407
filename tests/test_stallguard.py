"""The stall guard over real sockets: hal0d in front of upstreams that never finish, fall silent,
stall in the middle of a line, or stream audio. Bounds are fractions of a second; timings are
asserted as ranges measured on the client's side of the socket."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
import structlog
from aiohttp import hdrs, web

from hal0d.protocol.sse import Decoder
from tests.harness.client import chat_body
from tests.harness.poll import eventually

NOTICE = "\n\n[hal0] stall guard:"
TRIPPED = "dispatch.stream_stall_guard_tripped"
# Slack allowed after a bound: the "within 0.5 s after it".
SLACK = 0.5
# Loopback latency between hal0d receiving a chunk and the client receiving it.
EPSILON = 0.05


@dataclass
class Received:
    status: int
    headers: Any
    started: float
    ended: float
    chunks: list[tuple[float, bytes]]

    @property
    def raw(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def last_upstream_chunk_at(self) -> float:
        """When the client got the last chunk that is not hal0d's own frame."""
        return max(at for at, data in self.chunks if b"x_hal0_stall" not in data)


async def receive(
    http: aiohttp.ClientSession, url: Any, body: dict[str, Any]
) -> Received:
    started = time.monotonic()
    async with asyncio.timeout(5), http.post(url, json=body) as resp:  # a guard that never trips
        chunks: list[tuple[float, bytes]] = []
        async for data in resp.content.iter_any():
            chunks.append((time.monotonic(), data))
        ended = time.monotonic()
        return Received(resp.status, resp.headers, started, ended, chunks)


def sse_data(raw: bytes) -> list[str]:
    return [event.data for event in Decoder().feed(raw)]


def stall_frame(raw: bytes) -> dict[str, Any]:
    """The stream ends with hal0d's frame as its own event, then [DONE]; return the frame."""
    events = sse_data(raw)
    assert events[-1] == "[DONE]", events[-3:]
    frame: dict[str, Any] = orjson.loads(events[-2])
    assert frame["id"] == "hal0-stall-guard"
    return frame


def assert_chat_frame(frame: dict[str, Any], reason: str) -> None:
    assert frame["object"] == "chat.completion.chunk"
    [choice] = frame["choices"]
    assert choice["index"] == 0
    assert choice["delta"]["role"] == "assistant"
    assert choice["delta"]["content"].startswith(NOTICE)
    assert reason in choice["delta"]["content"]
    assert choice["finish_reason"] == "length"
    stall = frame["x_hal0_stall"]
    assert stall["reason"] == reason
    assert stall["upstream"] == "llm"
    assert isinstance(stall["elapsed_s"], float | int)


async def wait_for_stub_line(stub: Any, word: str, within: float) -> None:
    def logged() -> bool:
        assert any(word in line for line in stub.lines()), stub.lines()
        return True

    await eventually(logged, within, f"{word!r} in the stub's log")


def guard(total: float, idle: float, **more: float) -> dict[str, float]:
    return {"stream_total_timeout_s": total, "stream_idle_timeout_s": idle, **more}


async def test_chatty_upstream_is_cut_at_the_total_bound_with_a_chat_frame_and_closed_upstream(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.6, idle=0))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chatty"))

    assert got.status == 200
    assert got.headers[hdrs.CONTENT_TYPE].startswith("text/event-stream")
    assert 0.6 <= got.duration <= 0.6 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "total")
    assert "stream_total_timeout_s = 0.6" in frame["choices"][0]["delta"]["content"]
    assert 0.6 <= frame["x_hal0_stall"]["elapsed_s"] <= 0.6 + SLACK
    # Everything before the frame is the upstream's own, never-finishing stream.
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    assert len(relayed) > 10
    assert all(chunk["id"] != "hal0-stall-guard" for chunk in relayed)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in relayed)
    # The frame opens with a blank line and is the last thing before [DONE].
    assert got.raw.endswith(b"data: [DONE]\n\n")
    await wait_for_stub_line(stub, "cancelled", within=1.0)


@pytest.mark.parametrize("total", [0, 5.0], ids=["total-off", "total-large"])
async def test_silent_upstream_is_cut_at_the_idle_bound_with_reason_idle(
    stub, start_hal0d, http, total
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=total, idle=0.4))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert got.status == 200
    silence = got.ended - got.last_upstream_chunk_at()
    assert 0.4 - EPSILON <= silence <= 0.4 + SLACK
    assert 0.4 <= got.duration <= 0.4 + SLACK + 0.2
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "idle")
    assert "stream_idle_timeout_s = 0.4" in frame["choices"][0]["delta"]["content"]
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    contents = [c["choices"][0]["delta"].get("content") for c in relayed[1:]]
    assert len(contents) == 3 and all(contents)  # the stub's three tokens, then silence
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_silent_upstream_trips_the_total_bound_when_it_comes_before_the_idle_one(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.3, idle=0.6))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert 0.3 <= got.duration <= 0.3 + SLACK
    assert_chat_frame(stall_frame(got.raw), "total")


async def test_idle_bound_does_not_trip_while_chunks_come_faster_than_it(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=1.0, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chatty"))

    assert 1.0 <= got.duration <= 1.0 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "total")
    assert 1.0 <= frame["x_hal0_stall"]["elapsed_s"] <= 1.0 + SLACK


async def test_frame_after_a_half_written_data_line_parses_as_its_own_event_before_done(
    upstream_app, start_hal0d, http
):
    complete = b'data: {"id":"x","choices":[{"delta":{"role":"assistant"}}]}\n\n'
    half = b'data: {"id":"x","choices":[{"delta":{"content":"hel'

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(complete)
        await asyncio.sleep(0.02)  # upstream pacing: the half line comes as a read of its own
        await response.write(half)
        await asyncio.Event().wait()  # stalled in the middle of the line, socket open
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    # The bytes before the frame are exactly the upstream's, the half line included.
    assert got.raw.startswith(complete + half)
    tail = got.raw[len(complete + half):]
    assert tail.startswith(b"\n\n")
    tail_events = sse_data(tail)
    assert len(tail_events) == 2 and tail_events[1] == "[DONE]"
    # A parser fed the whole stream sees the upstream's events, the frame, then [DONE].
    events = sse_data(got.raw)
    assert events[:2] == [complete[len(b"data: "):-2].decode(), half[len(b"data: "):].decode()]
    assert len(events) == 4
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "idle")
    assert orjson.loads(tail_events[0]) == frame


async def test_legacy_completions_stream_gets_a_text_completion_frame(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    body = {"model": "stall", "prompt": "hi", "stream": True}
    got = await receive(http, hal0d.make_url("/v1/completions"), body)

    assert got.status == 200
    assert 0.3 <= got.duration <= 0.3 + SLACK + 0.2
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    assert [chunk["object"] for chunk in relayed] == ["text_completion"] * 3
    frame = stall_frame(got.raw)
    assert frame["object"] == "text_completion"
    [choice] = frame["choices"]
    assert "delta" not in choice
    assert choice["text"].startswith(NOTICE) and "idle" in choice["text"]
    assert choice["finish_reason"] == "length"
    assert frame["x_hal0_stall"]["reason"] == "idle"
    assert frame["x_hal0_stall"]["upstream"] == "llm"
    assert "elapsed_s" in frame["x_hal0_stall"]


async def test_silent_audio_stream_is_cut_with_no_bytes_added(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    body = {"model": "stall", "input": "hello", "voice": "x"}
    got = await receive(http, hal0d.make_url("/v1/audio/speech"), body)

    assert got.status == 200
    assert got.headers[hdrs.CONTENT_TYPE] == "audio/wav"
    assert got.raw == b"".join(bytes([i % 256]) * 1024 for i in range(3))
    assert 0.3 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.3 + SLACK
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_chatty_audio_stream_is_cut_at_the_total_bound_with_no_bytes_added(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.4, idle=0))
    body = {"model": "chatty", "input": "hello", "voice": "x"}
    got = await receive(http, hal0d.make_url("/v1/audio/speech"), body)

    assert 0.4 <= got.duration <= 0.4 + SLACK
    raw = got.raw
    assert len(raw) >= 5 * 1024
    expected = b"".join(bytes([i % 256]) * 1024 for i in range(len(raw) // 1024 + 1))
    assert raw == expected[: len(raw)]  # a prefix of what the upstream sent, nothing injected
    await wait_for_stub_line(stub, "cancelled", within=1.0)


def relayed_deltas(raw: bytes) -> list[tuple[Any, Any]]:
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(data) for data in events[:-1]]
    assert all("x_hal0_stall" not in chunk and chunk["id"] != "hal0-stall-guard"
               for chunk in chunks)
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]


async def test_long_slow_healthy_stream_is_relayed_untouched_with_bounds_off_or_generous(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.05)
    disabled = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0))
    generous = await start_hal0d(stub.url, dispatcher=guard(total=3.0, idle=0.5))
    body = chat_body("reasoning", content="long", max_tokens=30)
    direct, *via = await asyncio.gather(
        receive(http, f"{stub.url}/v1/chat/completions", body),
        receive(http, disabled.make_url("/v1/chat/completions"), body),
        receive(http, generous.make_url("/v1/chat/completions"), body),
    )

    expected = relayed_deltas(direct.raw)
    assert expected[-1] == ({}, "length")
    for got in via:
        assert got.status == 200
        assert got.duration >= 1.4  # longer than every bound the other tests trip
        assert b"x_hal0_stall" not in got.raw and b"[hal0]" not in got.raw
        assert got.raw.endswith(b"data: [DONE]\n\n")
        assert relayed_deltas(got.raw) == expected
    assert sum(1 for line in stub.lines() if line.split()[1] == "end") == 3


async def test_with_both_bounds_off_the_per_read_timeout_trips_with_reason_read(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(
        stub.url, dispatcher=guard(total=0, idle=0, direct_read_timeout_s=0.5)
    )
    with structlog.testing.capture_logs() as logs:
        got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert got.status == 200
    assert 0.5 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.5 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "read")
    assert [e["reason"] for e in logs if e["event"] == TRIPPED] == ["read"]
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_per_read_timeout_is_off_while_the_guard_owns_the_stream(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(
        stub.url, dispatcher=guard(total=0, idle=0.6, direct_read_timeout_s=0.2)
    )
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert 0.6 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.6 + SLACK
    assert_chat_frame(stall_frame(got.raw), "idle")


async def test_guard_clocks_start_once_the_upstream_headers_arrive(
    upstream_app, start_hal0d, http
):
    events = [b'data: {"id":"x","choices":[{"delta":{"content":"%d"}}]}\n\n' % i
              for i in range(3)] + [b"data: [DONE]\n\n"]

    async def upstream(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.5)  # a slow prompt: no headers yet
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0.1)  # an upstream that paces its tokens
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    # Counted from the request, 0.6 s would cut the stream; counted from the headers it fits.
    hal0d = await start_hal0d(url, dispatcher=guard(total=0.6, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    assert got.duration >= 0.8
    assert got.raw == b"".join(events)


async def test_header_wait_is_bounded_by_the_read_timeout_not_by_the_guard(
    upstream_app, start_hal0d, http
):
    async def upstream(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    setup = {"pool_timeout_s": 0.05, "connect_timeout_s": 0.05, "write_timeout_s": 0.05}
    hal0d = await start_hal0d(
        url, dispatcher=guard(total=0.2, idle=0.1, direct_read_timeout_s=0.5, **setup)
    )
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        body = await resp.json()
    waited = time.monotonic() - started

    assert resp.status == 502
    assert body["error"]["code"] == "dispatch.upstream_unavailable"
    assert 0.5 <= waited <= 0.65 + SLACK


async def test_each_trip_logs_one_line_with_reason_elapsed_and_upstream(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    with structlog.testing.capture_logs() as logs:
        got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))
        await eventually(lambda: any(e["event"] == "request.done" for e in logs), 0.5,
                         "request.done logged")

    assert_chat_frame(stall_frame(got.raw), "idle")
    [tripped] = [e for e in logs if e["event"] == TRIPPED]
    assert {"reason", "elapsed_s", "upstream"} <= tripped.keys()
    assert tripped["reason"] == "idle"
    assert tripped["upstream"] == "llm"
    assert 0.3 <= tripped["elapsed_s"] <= 0.3 + SLACK
    assert tripped["log_level"] == "warning"
    [done] = [e for e in logs if e["event"] == "request.done"]
    assert done["ok"] is False
    assert done["error_code"] == "stream_stall_idle"


def audio_upstream(pieces: list[bytes]) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that writes `pieces` of audio as fast as hal0d takes them."""

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "audio/wav"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
        await response.write_eof()
        return response

    return upstream


async def test_a_slow_client_is_not_blamed_on_the_upstream(upstream_app, start_hal0d, http):
    pieces = [bytes([i]) * 2**20 for i in range(24)]

    url = await upstream_app({"POST /v1/audio/speech": audio_upstream(pieces)})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=0.3))
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(5), http.post(
            hal0d.make_url("/v1/audio/speech"), json={"model": "chat", "input": "x"}
        ) as resp:
            first = await resp.content.readany()
            await asyncio.sleep(0.8)  # hal0d's writes block on us far longer than the idle bound
            raw = first + await resp.read()

    assert not [e for e in logs if e["event"] == TRIPPED]
    assert raw == b"".join(pieces)


async def test_a_loop_that_was_away_past_the_idle_bound_does_not_blame_an_upstream_that_spoke(
    upstream_app, start_hal0d, http
):
    """A turn of hal0d's event loop that takes longer than the idle bound (a long callback, a
    collection, a starved process) makes the guard's check late: what the upstream sent while
    the loop was away is still unread, and is no stall."""
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
    rest = (b'data: {"choices":[{"index":0,"delta":{"content":"Hello"}}]}\n\n'
            b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
            b"data: [DONE]\n\n")

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(role)
        await asyncio.sleep(0.1)  # well inside the idle bound, but due while the loop is away
        await response.write(rest)
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=0.3))
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(5), http.post(hal0d.make_url("/v1/chat/completions"),
                                                 json=chat_body()) as resp:
            first = await resp.content.readany()
            # hal0d, its upstream and this client share one loop here: all of them away at once,
            # past both the upstream's next write and the guard's idle check.
            time.sleep(0.5)
            raw = first + await resp.read()

    assert not [e for e in logs if e["event"] == TRIPPED]
    assert raw == role + rest


async def test_a_loop_that_was_away_past_the_client_bound_does_not_cut_a_client_that_read(
    upstream_app, start_hal0d, http
):
    """The same for the client's side: a write that waits on a client which reads again while
    hal0d's loop is away is no stalled client."""
    pieces = [bytes([i]) * 2**20 for i in range(16)]

    url = await upstream_app({"POST /v1/audio/speech": audio_upstream(pieces)})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=0.3, direct_read_timeout_s=0.3))
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logs:
        async with asyncio.timeout(5), http.post(
            hal0d.make_url("/v1/audio/speech"), json={"model": "chat", "input": "x"}
        ) as resp:
            first = await resp.content.readany()
            # hal0d's writes wait on this client, which reads again after 0.1 s; the loop they
            # share is away from 0.05 s to 0.55 s, past the guard's client bound (0.3 s).
            loop.call_later(0.05, time.sleep, 0.5)
            await asyncio.sleep(0.1)
            raw = first + await resp.read()

    assert not [e for e in logs if e["event"] in (TRIPPED, "dispatch.client_stalled")]
    assert raw == b"".join(pieces)


def llm_slot(snapshot: dict[str, Any]) -> dict[str, Any]:
    [slot] = [s for s in snapshot["slots"] if s["name"] == "llm"]
    return slot


async def test_slot_is_released_after_a_trip(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    async with http.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body("stall")
    ) as resp:
        await resp.content.readuntil(b"\n\n")  # the stream is flowing
        async with http.get(hal0d.make_url("/api/slots")) as during:
            assert llm_slot(await during.json())["in_flight"] == 1
        raw = await resp.read()
    assert b"x_hal0_stall" in raw

    async def released() -> dict[str, Any]:
        async with http.get(hal0d.make_url("/api/slots")) as after:
            slot = llm_slot(await after.json())
        assert slot["in_flight"] == 0, slot
        return slot

    slot = await eventually(released, 0.2, "the slot released after the trip")
    assert slot["queued"] == 0
    # The released slot serves the next request at once.
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chat"))
    assert got.raw.endswith(b"data: [DONE]\n\n") and b"x_hal0_stall" not in got.raw


async def open_raw_stream(hal0d: Any, model: str) -> tuple[asyncio.StreamReader,
                                                          asyncio.StreamWriter]:
    """A client that sends its request and then reads only when the test says so. Its socket's
    receive buffer is small, so once it stops reading, hal0d's writes to it block within
    milliseconds however busy the machine is (a grown buffer took seconds to fill under load)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (hal0d.host, hal0d.port))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = orjson.dumps(chat_body(model, max_tokens=1_000_000))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                 + body)
    await writer.drain()
    return reader, writer


async def history_row(http: aiohttp.ClientSession, hal0d: Any) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        rows = (await resp.json())["requests"]
    return rows[0] if rows else {}


async def test_a_client_that_stops_reading_is_cut_and_frees_its_slot(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0)  # a flood: the client's socket buffers fill at once
    hal0d = await start_hal0d(stub.url, dispatcher=guard(0, 0, direct_read_timeout_s=0.5))
    _, writer = await open_raw_stream(hal0d, "chatty")
    started = time.monotonic()

    async def released() -> bool:  # never reading: hal0d's write blocks, the client bound ends it
        async with http.get(hal0d.make_url("/api/slots")) as resp:
            slot = llm_slot(await resp.json())
        assert slot["in_flight"] == 0, slot
        return True

    # The flood first fills the socket buffers on the way to the client, slower on a busy box:
    # the wait is the next test's, and the bound is asserted below.
    await eventually(released, 8.0, "the slot freed from the client that stopped reading")
    assert time.monotonic() - started >= 0.5
    row = await history_row(http, hal0d)
    assert (row["ok"], row["error_code"]) == (False, "client_stalled")
    await wait_for_stub_line(stub, "cancelled", 1.0)
    writer.close()


async def test_a_trip_while_the_client_is_slow_is_recorded_as_the_trip(
    start_stub, start_hal0d, http
):
    """The total bound runs out while hal0d waits for a slow client to take a write: the
    client still gets the stall frame and [DONE] once it reads, and the row names the trip."""
    stub = await start_stub(delay=0)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(0.5, 0))
    reader, writer = await open_raw_stream(hal0d, "chatty")
    # Kept: not reading for this long IS the slow client under test (the total bound runs out
    # while hal0d's write is blocked; hal0d shows nothing of that until the write returns).
    await asyncio.sleep(1.0)
    raw = b""
    async with asyncio.timeout(5):
        while not raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):  # chunked framing
            chunk = await reader.read(1 << 20)
            assert chunk, raw[-300:]
            raw += chunk
    assert b'"x_hal0_stall":{"reason":"total"' in raw
    row = await eventually(lambda: history_row(http, hal0d), 5.0, "the stream's history row")
    assert (row["ok"], row["error_code"]) == (False, "stream_stall_total")
    writer.close()


async def test_a_client_that_stops_reading_is_still_cut_after_the_total_bound_ran_out(
    upstream_app, start_hal0d, http
):
    """The total bound runs out while hal0d's write waits on a client that never reads again:
    the trip cannot reach a relay blocked in a write, so the client bound still ends it (one
    timer watches both), the slot is freed, and the row says the client was cut for stalling
    (it did not leave)."""
    cancelled = asyncio.Event()
    # Events of 64 KiB: a few of them fill the client's buffers and block hal0d's write at once,
    # however busy the machine is (small ones took longer than the total bound under load).
    event = b'data: {"choices":[{"index":0,"delta":{"content":"' + b"x" * 65536 + b'"}}]}\n\n'

    async def flood(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(event)
        except (asyncio.CancelledError, ConnectionResetError):
            cancelled.set()
            raise

    url = await upstream_app({"POST /v1/chat/completions": flood})
    hal0d = await start_hal0d(url, dispatcher=guard(1.0, 0, direct_read_timeout_s=2.0))
    _, writer = await open_raw_stream(hal0d, "chatty")
    started = time.monotonic()

    async def released() -> bool:
        async with http.get(hal0d.make_url("/api/slots")) as resp:
            slot = llm_slot(await resp.json())
        assert slot["in_flight"] == 0, slot
        return True

    await eventually(released, 8.0, "the slot freed from the client that stopped reading")
    assert time.monotonic() - started >= 2.0  # the client bound, not the total one, freed it
    row = await history_row(http, hal0d)
    assert (row["ok"], row["error_code"]) == (False, "client_stalled")  # cut, not gone
    await asyncio.wait_for(cancelled.wait(), 1.0)  # the upstream's generation was cancelled
    writer.close()


async def test_a_guarded_body_is_not_bound_by_the_header_wait_timeout(
    upstream_app, start_hal0d, http
):
    """The per-read timeout bounds the header wait only: once the headers are in, the guard's
    bounds alone watch the body (a token may take longer than a header wait may)."""
    events = [b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n', b"data: [DONE]\n\n"]

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.8)  # past the header wait's 0.3 s, within the idle bound's 2 s
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=2.0, direct_read_timeout_s=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    assert got.raw == b"".join(events)  # whole, with no stall frame
    assert got.duration >= 0.8
