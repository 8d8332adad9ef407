"""The upstream pool over real sockets: a kept-alive connection that an upstream spoiled (bytes
it sent after a whole answer, a close as the connection was reused) is not the next request's
502, and a fresh connection that fails is not tried twice.

The upstreams here are raw asyncio servers: aiohttp's own would not misbehave.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import orjson
import pytest
from structlog.testing import capture_logs

from tests.harness.client import chat_body

ANSWER = orjson.dumps({
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "chat",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello"}}],
    "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4},
})
WHOLE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
         b"Content-Length: %d\r\n\r\n" % len(ANSWER) + ANSWER)
STRAY = b"xxxxx"
CHAT = "/v1/chat/completions"


@dataclass
class Seen:
    """What a raw upstream saw: per request, its path and the number of its connection."""

    requests: list[tuple[str, int]] = field(default_factory=list)
    server: asyncio.Server | None = None

    def posts(self) -> list[int]:
        return [conn for path, conn in self.requests if path == CHAT]


# How a raw upstream answers one request: (writer, the request's number on its connection);
# False closes the connection without answering.
Answer = Callable[[asyncio.StreamWriter, int], Awaitable[bool]]


async def read_request(reader: asyncio.StreamReader) -> str | None:
    """One request head and its Content-Length body: its path; None at the end."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    lines = head.split(b"\r\n")
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return lines[0].split(b" ")[1].decode()


@pytest.fixture
async def raw_upstream() -> AsyncIterator[Callable[[Answer], Awaitable[tuple[str, Seen]]]]:
    """Start a raw HTTP/1.1 server on loopback that answers every request with `answer`, keeping
    the connection open; its URL, and what it saw."""
    servers: list[asyncio.Server] = []

    async def start(answer: Answer) -> tuple[str, Seen]:
        seen = Seen()
        connections = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal connections
            connections += 1
            mine, served = connections, 0
            try:
                while (path := await read_request(reader)) is not None:
                    seen.requests.append((path, mine))
                    if not await answer(writer, served):
                        break
                    served += 1
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        server = seen.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def stray_after_each_answer(writer: asyncio.StreamWriter, served: int) -> bool:
    """A whole Content-Length answer, and 5 bytes more after it. Written when the connection's
    next request has come, so they reach hal0d after it took the connection again (bytes that
    reach an idle connection make aiohttp close it on their arrival)."""
    writer.write((STRAY if served else b"") + WHOLE)
    return True


async def close_on_reuse(writer: asyncio.StreamWriter, served: int) -> bool:
    """The keep-alive race: a server that closed the idle connection as hal0d reused it."""
    if served:
        return False
    writer.write(WHOLE)
    return True


async def garbage(writer: asyncio.StreamWriter, served: int) -> bool:
    writer.write(STRAY * 4 + b"\r\n\r\n")
    return False


async def chat(http, hal0d) -> tuple[int, bytes]:
    async with http.post(hal0d.make_url(CHAT), json=chat_body("chat", stream=False)) as resp:
        return resp.status, await resp.read()


@pytest.mark.parametrize(("answer", "reason"), [
    pytest.param(stray_after_each_answer, "not_an_answer", id="stray bytes after each answer"),
    pytest.param(close_on_reuse, "disconnected", id="closed as it was reused"),
])
async def test_a_spoiled_kept_alive_connection_is_retried_once_on_a_fresh_one(
    answer, reason, raw_upstream, start_hal0d, http
):
    url, seen = await raw_upstream(answer)
    hal0d = await start_hal0d(url, models=("chat",))
    with capture_logs() as logs:
        for _ in range(3):
            status, body = await chat(http, hal0d)
            assert status == 200, body
            assert orjson.loads(body)["choices"][0]["message"]["content"] == "Hello"
    retried = [e for e in logs if e["event"] == "upstream.retried"]
    assert retried and {e["reason"] for e in retried} == {reason}
    assert retried[0]["log_level"] == "info" and retried[0]["upstream"] == url
    # Each request that met a spoiled connection went out once more, on a connection of its own.
    posts = seen.posts()
    assert len(posts) == 3 + len(retried)
    assert len(set(posts)) == len(retried) + 1, posts  # each retry on a new connection


async def test_an_idle_connection_that_got_stray_bytes_is_not_reused(
    raw_upstream, start_hal0d, http
):
    """The bytes arrive while the connection is idle: it is closed then, and the next request
    connects anew without a retry."""

    async def stray_soon_after(writer: asyncio.StreamWriter, served: int) -> bool:
        writer.write(WHOLE)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(STRAY)
        return True

    url, seen = await raw_upstream(stray_soon_after)
    hal0d = await start_hal0d(url, models=("chat",))
    with capture_logs() as logs:
        for _ in range(2):
            await asyncio.sleep(0.2)  # the stray bytes have reached the idle connection
            status, body = await chat(http, hal0d)
            assert status == 200, body
    assert not [e for e in logs if e["event"] == "upstream.retried"]
    assert len(set(seen.posts())) == 2


async def test_a_fresh_connection_that_fails_is_not_tried_twice(raw_upstream, start_hal0d, http):
    """Only a kept-alive connection is suspect: an upstream that answers a new connection with
    garbage gets the request once, and the client its 502."""
    url, seen = await raw_upstream(garbage)
    hal0d = await start_hal0d(url, models=("chat",))
    status, body = await chat(http, hal0d)
    assert status == 502
    assert orjson.loads(body)["error"]["code"] == "dispatch.upstream_unavailable"
    assert len(seen.posts()) == 1


async def test_an_upstream_gone_after_taking_the_request_fails_it_as_it_failed_first(
    raw_upstream, start_hal0d, http
):
    """The retry finds no upstream to connect to (a process that died of the request): the
    client's 502 is the first failure, a disconnect after the request was sent, not a refused
    connect, which would say that nothing was sent."""
    seen: Seen

    async def die_on_reuse(writer: asyncio.StreamWriter, served: int) -> bool:
        if not served:
            writer.write(WHOLE)
            return True
        assert seen.server is not None
        seen.server.close()  # no more connections: the retry is refused
        return False

    url, seen = await raw_upstream(die_on_reuse)
    hal0d = await start_hal0d(url, models=("chat",))
    with capture_logs() as logs:
        status, body = await chat(http, hal0d)
        if status == 200:  # it had a connection of its own: the next one is kept alive
            status, body = await chat(http, hal0d)
    assert status == 502
    error = orjson.loads(body)["error"]
    assert error["code"] == "dispatch.upstream_unavailable"
    assert error["message"] == ("slot 'llm' is unavailable: connection closed waiting for the "
                                "upstream's response headers"), error
    [logged] = [entry for entry in logs if entry["event"] == "upstream.unavailable"]
    assert logged["upstream"] == url and logged["error"].startswith("ServerDisconnectedError")
    assert seen.requests[-1][0] == CHAT and len(set(seen.posts())) == 1
