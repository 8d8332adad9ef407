"""The stall guard and the client over real sockets: a slow client is not blamed on the upstream,
a loop that was away past a bound blames neither side, and a client that stops reading is cut
(its slot freed, its row `client_stalled`), after the total bound ran out too; a trip while the
client is slow is recorded as the trip."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import hdrs, web

from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.stallguard import TRIPPED, guard, llm_slot, wait_for_stub_line


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
