"""The lean HTTP/1.1 client of whole answers (h1client.py), against real sockets: an aiohttp
upstream for the ordinary answers, a raw asyncio server for the odd ones."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from hal0d.h1client import CannotConnect, H1Pool, UpstreamClosed, WholeResponse
from tests.conftest import eventually, free_port

JSON = CIMultiDict({"Content-Type": "application/json"})


@pytest.fixture
async def pool() -> AsyncIterator[H1Pool]:
    pool = H1Pool()
    yield pool
    pool.close()


async def ask(pool: H1Pool, url: URL, body: bytes = b"{}", *, read_timeout_s: float = 5.0,
              headers: CIMultiDict[str] = JSON) -> WholeResponse:
    return await pool.request("POST", url, headers=headers, body=body, connect_timeout_s=5.0,
                              read_timeout_s=read_timeout_s)


RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture
async def raw_server() -> AsyncIterator[Callable[[RawHandler], Awaitable[URL]]]:
    servers: list[asyncio.Server] = []

    async def start(handler: RawHandler) -> URL:
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        servers.append(server)
        port = server.sockets[0].getsockname()[1]
        return URL(f"http://127.0.0.1:{port}/v1/embeddings")

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    return head + await reader.readexactly(length)


async def test_answers_reuse_one_connection_and_carry_status_headers_and_body(
    pool: H1Pool, aiohttp_server: Callable[..., Awaitable[object]]
) -> None:
    peers: list[int] = []
    seen: list[tuple[str, str, bytes]] = []

    async def embeddings(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername")[1])  # type: ignore[union-attr]
        seen.append((request.headers["Host"], request.path_qs, await request.read()))
        return web.json_response({"n": len(peers)}, status=201, headers={"X-Upstream": "yes"})

    app = web.Application()
    app.router.add_post("/v1/embeddings", embeddings)
    server = await aiohttp_server(app)
    url = URL(str(server.make_url("/v1/embeddings")))  # type: ignore[attr-defined]
    for n in range(1, 4):
        response = await ask(pool, url, b'{"input": "hi"}')
        assert (response.status, response.content_type) == (201, "application/json")
        assert response.headers["X-Upstream"] == "yes"
        assert await response.read() == b'{"n": %d}' % n
        response.release()
    assert len(set(peers)) == 1  # one keep-alive connection for the three
    assert seen[0] == (f"127.0.0.1:{url.port}", "/v1/embeddings", b'{"input": "hi"}')


async def test_the_query_goes_with_the_request(
    pool: H1Pool, aiohttp_server: Callable[..., Awaitable[object]]
) -> None:
    async def echo(request: web.Request) -> web.Response:
        return web.Response(text=request.query["a"])

    app = web.Application()
    app.router.add_post("/v1/embeddings", echo)
    server = await aiohttp_server(app)
    url = URL(str(server.make_url("/v1/embeddings")))  # type: ignore[attr-defined]
    response = await pool.request("POST", url, headers=JSON, body=b"{}", params={"a": "1 2"},
                                  connect_timeout_s=5.0, read_timeout_s=5.0)
    assert await response.read() == b"1 2"


@pytest.mark.parametrize("framing", ["chunked", "until-close", "after-100-continue"])
async def test_every_framing_gives_the_whole_body(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]], framing: str
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        if framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n"
                         b"3\r\n{\"a\r\n4\r\n\": 1\r\n1\r\n}\r\n0\r\n\r\n")
        elif framing == "until-close":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\n\r\n{\"a\": 1}")
            await writer.drain()
            writer.close()
            return
        else:
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 8\r\n\r\n{\"a\": 1}")
        await writer.drain()
        await asyncio.sleep(30)

    url = await raw_server(handler)
    response = await ask(pool, url)
    assert response.status == 200
    assert await response.read() == b'{"a": 1}'
    response.release()


async def test_an_answer_cut_short_is_upstream_closed(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"partial\"")
        await writer.drain()
        writer.close()

    response = await ask(pool, await raw_server(handler))
    with pytest.raises(UpstreamClosed):
        await response.read()
    response.release()


async def test_what_is_not_http_is_upstream_closed(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(30)

    with pytest.raises(UpstreamClosed, match="not HTTP"):
        await ask(pool, await raw_server(handler))


async def test_headers_that_never_come_time_out(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(30)

    with pytest.raises(TimeoutError):
        await ask(pool, await raw_server(handler), read_timeout_s=0.2)


async def test_a_refused_connect_is_cannot_connect_with_the_sockets_error(pool: H1Pool) -> None:
    with pytest.raises(CannotConnect) as caught:
        await ask(pool, URL(f"http://127.0.0.1:{free_port()}/v1/embeddings"))
    assert isinstance(caught.value.os_error, ConnectionRefusedError)


async def test_a_line_break_in_a_header_is_refused_before_anything_is_sent(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    got: list[bytes] = []

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        got.append(await reader.read(1000))

    url = await raw_server(handler)
    with pytest.raises(ValueError, match="line break"):
        await ask(pool, url, headers=CIMultiDict({"X-Evil": "a\r\nX-Injected: 1"}))
    assert got == []


async def test_a_cancelled_request_closes_its_connection(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    """The client left: the upstream sees its connection end (and stops generating)."""
    ended = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()  # EOF: hal0d closed the connection
        ended.set()

    task = asyncio.ensure_future(ask(pool, await raw_server(handler)))
    await asyncio.sleep(0.2)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(ended.wait(), 2.0)


async def test_a_connection_the_upstream_closed_while_idle_is_not_reused(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # a keep-alive answer, then the server ends the idle connection

    url = await raw_server(handler)
    first = await ask(pool, url)
    assert await first.read() == b"ok"
    first.release()
    await eventually(lambda: all(c.closed for idle in pool._idle.values() for c in idle), 2.0,
                     "the idle connection seen closed")
    second = await ask(pool, url)
    assert await second.read() == b"ok"
    assert connections == 2


async def test_a_body_that_never_ends_times_out_and_its_connection_is_not_reused(
    pool: H1Pool, raw_server: Callable[[RawHandler], Awaitable[URL]]
) -> None:
    connections = 0

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_request(reader)
        if connections == 1:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n{\"a\"")  # and no more
        else:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        await asyncio.sleep(30)

    url = await raw_server(handler)
    stuck = await ask(pool, url)
    with pytest.raises(TimeoutError):
        await stuck.read(0.2)
    stuck.release()
    fresh = await ask(pool, url)
    assert await fresh.read(5.0) == b"ok"
    assert connections == 2
