"""write_timeout_s over real sockets: every wait while a request's body is sent to an upstream is
bounded by it (aiohttp bounds no write), and a slow upload that keeps moving is not cut.

The upstreams are raw asyncio servers with a small receive buffer, so that hal0d's writes wait
on them as soon as they stop reading.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
import pytest
from structlog.testing import capture_logs

from tests.harness.client import chat_body

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone

ANSWER = orjson.dumps({"id": "chatcmpl-1", "object": "chat.completion", "created": 0,
                       "model": "chat", "choices": []})
RECEIVE_BUFFER = 256 * 1024
# Twice what the sockets' buffers on loopback hold (about 4 MiB, hal0d's send buffer most of it).
BODY_TEXT = "x" * (8 * 1024 * 1024)
WRITE_S = 0.25
PAUSE_S = 0.12  # shorter than WRITE_S
Reader = Callable[[asyncio.StreamReader, int], Awaitable[None]]


@pytest.fixture
async def reading_upstream() -> AsyncIterator[Callable[[Reader], Awaitable[tuple[str, list]]]]:
    """Start a raw HTTP/1.1 server that reads a request's head, then its body as `read_body`
    does (given the reader and the Content-Length), then answers, keeping the connection; its
    URL, and per request with a body the seconds that body took to arrive."""
    servers: list[asyncio.Server] = []

    async def start(read_body: Reader) -> tuple[str, list[float]]:
        took: list[float] = []

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), 0)
                    if length:  # the chat request; the health probe's GET has no body
                        started = time.monotonic()
                        await read_body(reader, length)
                        took.append(time.monotonic() - started)
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        sock = socket.socket()
        # Set before listen(): accepted sockets inherit it, and the window stays small.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)
        sock.bind(("127.0.0.1", 0))
        server = await asyncio.start_server(serve, sock=sock)
        servers.append(server)
        return f"http://127.0.0.1:{sock.getsockname()[1]}", took

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


DISPATCHER = {"write_timeout_s": WRITE_S, "connect_timeout_s": 1.0,
              "direct_read_timeout_s": 5.0}


async def test_an_upstream_that_takes_none_of_the_body_is_a_502_within_the_write_timeout(
    reading_upstream, start_hal0d, http
):
    async def never(reader: asyncio.StreamReader, length: int) -> None:
        await asyncio.Event().wait()

    url, _ = await reading_upstream(never)
    hal0d = await start_hal0d(url, models=("chat",), dispatcher=DISPATCHER)
    for stream in (False, True):
        started = time.monotonic()
        with capture_logs() as logs:
            async with http.post(hal0d.make_url("/v1/chat/completions"),
                                 json=chat_body("chat", stream=stream, content=BODY_TEXT)
                                 ) as resp:
                body = await resp.json()
        waited = time.monotonic() - started
        assert resp.status == 502, body
        assert body["error"]["message"] == (
            "slot 'llm' is unavailable: timed out sending the request")
        [logged] = [entry for entry in logs if entry["event"] == "upstream.unavailable"]
        assert logged["upstream"] == url and logged["error"].startswith("WriteTimeout")
        # Not the open's whole bound (connect + write + headers: 6.25 s).
        assert waited < 3.0


async def test_a_slow_upload_that_keeps_moving_is_not_cut(reading_upstream, start_hal0d, http):
    """The bound is on each wait, not on the whole: an upstream that stops reading for less than
    write_timeout_s, again and again, takes a body that needs longer than that to arrive."""

    async def with_pauses(reader: asyncio.StreamReader, length: int) -> None:
        while length:
            await asyncio.sleep(PAUSE_S)
            length -= len(await reader.readexactly(min(length, 1024 * 1024)))

    url, took = await reading_upstream(with_pauses)
    hal0d = await start_hal0d(url, models=("chat",), dispatcher=DISPATCHER)
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat", stream=False, content=BODY_TEXT)) as resp:
        assert resp.status == 200, await resp.text()
    # The test means something: more than the buffers could hide, so hal0d's writes waited,
    # in all, longer than write_timeout_s.
    assert took[0] > 3 * WRITE_S
