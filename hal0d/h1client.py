"""A lean HTTP/1.1 client for the requests whose answer is read whole (no stream).

Why not aiohttp's ClientSession here too: a small non-streamed request is what hal0d serves most
often (embeddings, rerank, tool loops, token counts), and aiohttp's client spends ~140 us of CPU on
one where this spends ~65 us (bench/README.md): it builds a request object, a response object, a
payload, a stream reader, timers and a connection key for every request, where this writes one
prepared buffer and hands the parser's pieces to one future. Streams stay on aiohttp (their
reads and the stall guard are built on its stream reader).

What it does: keep-alive connections per upstream address, one request at a time on each, opened
when none is idle; the answer parsed by httptools (llhttp, Node.js's parser): Content-Length,
chunked, or ended by the connection closing. What it leaves to aiohttp (upstream.py chooses):
https, redirects, proxies, compression, cookies; hal0d's whole answers use none of them.

Errors are OSErrors (UpstreamClosed, CannotConnect wrapping the socket's own) or TimeoutError, so
upstream.upstream_errors maps them as it maps aiohttp's. Cancelling a request (the client left)
closes its connection, which is how the upstream learns to stop generating.
"""

from __future__ import annotations

import asyncio
import collections
import time
from typing import Any, Final

import httptools
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

# An idle connection older than this is closed instead of reused: servers close idle keep-alive
# connections after a few seconds (uvicorn 5 s, llama-server longer), and a request written to
# one the server is closing at that instant is lost.
IDLE_REUSE_S: Final = 4.0
MAX_IDLE_PER_UPSTREAM: Final = 64
MAX_HEADER_BYTES: Final = 64 * 1024
LARGE_BODY: Final = 64 * 1024


class UpstreamClosed(ConnectionError):
    """The upstream closed the connection, or sent what is not HTTP, before the whole answer."""


class CannotConnect(ConnectionError):
    """The TCP connect failed; `os_error` is the socket's own error (as aiohttp names it)."""

    def __init__(self, os_error: OSError) -> None:
        super().__init__(os_error.errno, os_error.strerror or str(os_error))
        self.os_error = os_error


class _Connection(asyncio.Protocol):
    """One keep-alive connection: a request written, its answer parsed as it comes (the headers
    into `header_list`, then `headers_done`; the body into `body`, then `complete`)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.address = address
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset()

    def _reset(self) -> None:
        self.headers_done: asyncio.Future[None] | None = None
        self.complete: asyncio.Future[None] | None = None
        self.header_list: list[tuple[str, str]] = []
        self.header_bytes = 0
        self.body: list[bytes] = []
        self.until_close = False  # neither Content-Length nor chunked: the body ends at EOF
        self.keep_alive = False  # as the parser judged it when the answer was complete
        self.informational = False  # a 1xx (100 Continue): the answer is the message after it

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.headers_done is None:  # nothing asked: a stray byte ends the connection
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamClosed(f"the upstream's answer is not HTTP/1.1: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.until_close and self.headers_done is not None and self.headers_done.done():
            self._finish()  # the close is the end of this answer's body
        else:
            self._fail(UpstreamClosed("the upstream closed the connection before the whole "
                                      "answer" + (f" ({exc})" if exc else "")))

    # -- httptools callbacks ---------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise httptools.HttpParserError(f"headers over {MAX_HEADER_BYTES} bytes")
        self.header_list.append((name.decode("utf-8", "surrogateescape"),
                                 value.decode("utf-8", "surrogateescape")))

    def on_headers_complete(self) -> None:
        if self._parser.get_status_code() < 200:
            self.informational = True
            self.header_list = []
            return
        names = {name.lower() for name, _ in self.header_list}
        self.until_close = "content-length" not in names and "transfer-encoding" not in names
        if self.headers_done is not None and not self.headers_done.done():
            self.headers_done.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self.informational:
            self.informational = False
            return
        self.until_close = False
        self.keep_alive = self._parser.should_keep_alive()  # valid in this callback only
        self._finish()

    # -- one exchange ----------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.headers_done = loop.create_future()
        self.complete = loop.create_future()
        assert self.transport is not None
        self.transport.write(data)

    def status(self) -> int:
        return int(self._parser.get_status_code())

    def reusable(self) -> bool:
        complete = self.complete
        return (not self.closed and self.keep_alive and complete is not None and complete.done()
                and not complete.cancelled() and complete.exception() is None)

    def recycle(self) -> None:
        self._reset()
        self._parser = httptools.HttpResponseParser(self)
        self.idle_since = time.monotonic()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def _finish(self) -> None:
        if self.complete is not None and not self.complete.done():
            self.complete.set_result(None)

    def _fail(self, error: Exception) -> None:
        for future in (self.headers_done, self.complete):
            if future is not None and not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a request that already left must not warn


class WholeResponse:
    """An upstream's answer: status and headers once they arrived, the body by `read()`.
    As much of aiohttp's ClientResponse as the surfaces read of a whole answer."""

    __slots__ = ("_body", "_connection", "_pool", "content_type", "headers", "status")

    def __init__(self, pool: H1Pool, connection: _Connection) -> None:
        self._pool = pool
        self._connection: _Connection | None = connection
        self._body: bytes | None = None
        self.status = connection.status()
        self.headers = CIMultiDictProxy(CIMultiDict(connection.header_list))
        content_type = self.headers.get("Content-Type", "")
        self.content_type = (content_type.split(";", 1)[0].strip().lower()
                             or "application/octet-stream")

    async def read(self, timeout_s: float | None = None) -> bytes:
        """The whole body; TimeoutError if it is not all there within `timeout_s`."""
        if self._body is None:
            connection = self._connection
            assert connection is not None and connection.complete is not None, "read after close"
            await within(connection.complete, timeout_s)
            self._body = b"".join(connection.body)
            connection.body = []
        return self._body

    def release(self) -> None:
        """Hand the connection back for reuse if its answer was read whole; otherwise close it
        (the upstream stops generating)."""
        connection, self._connection = self._connection, None
        if connection is None:
            return
        if self._body is not None and connection.reusable():
            self._pool.put_back(connection)
        else:
            connection.close()

    def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()


class H1Pool:
    """Idle keep-alive connections by upstream address, and the requests made over them."""

    def __init__(self) -> None:
        self._idle: dict[tuple[str, int], collections.deque[_Connection]] = {}

    async def request(
        self,
        method: str,
        url: URL,
        *,
        headers: CIMultiDict[str],
        body: bytes,
        params: Any = None,
        connect_timeout_s: float,
        read_timeout_s: float,
    ) -> WholeResponse:
        """Send the request and wait for the answer's headers: the connect (when no idle
        connection is there) within `connect_timeout_s`, the headers within `read_timeout_s` of
        the request going out."""
        if params:
            url = url.extend_query(params)
        host, port = url.raw_host or "", url.port or 80
        head = request_head(method, url, headers, len(body))
        connection = self._idle_connection((host, port))
        if connection is None:
            connection = await self._connect(host, port, connect_timeout_s)
        try:
            # One write for a small body; a large one is not copied into the head's buffer.
            connection.send(head + body if len(body) < LARGE_BODY else head)
            if len(body) >= LARGE_BODY:
                assert connection.transport is not None
                connection.transport.write(body)
            assert connection.headers_done is not None
            await within(connection.headers_done, read_timeout_s)
        except BaseException:
            connection.close()
            raise
        return WholeResponse(self, connection)

    def _idle_connection(self, address: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(address)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to be closing
            if not connection.closed and now - connection.idle_since < IDLE_REUSE_S:
                return connection
            connection.close()
        return None

    async def _connect(self, host: str, port: int, timeout_s: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection((host, port)), host, port
                )
        except OSError as exc:
            raise CannotConnect(exc) from exc
        return connection

    def put_back(self, connection: _Connection) -> None:
        connection.recycle()
        idle = self._idle.setdefault(connection.address, collections.deque())
        if len(idle) >= MAX_IDLE_PER_UPSTREAM:
            idle.popleft().close()
        idle.append(connection)

    def close(self) -> None:
        for idle in self._idle.values():
            while idle:
                idle.pop().close()
        self._idle.clear()


async def within(future: asyncio.Future[None], timeout_s: float | None) -> None:
    """Await `future`, failing it with TimeoutError after `timeout_s`. A timer on the future
    itself: asyncio.timeout() costs several times more, and this runs twice a request."""
    if timeout_s is None or future.done():
        await future
        return
    timer = asyncio.get_running_loop().call_later(timeout_s, _time_out, future)
    try:
        await future
    finally:
        timer.cancel()


def _time_out(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


def request_head(method: str, url: URL, headers: CIMultiDict[str], length: int) -> bytes:
    """The request line and headers, as one buffer. Header values come from a parsed request
    or from the configuration; a CR or LF in one would split the request, so it is refused."""
    lines = [f"{method} {url.raw_path_qs} HTTP/1.1\r\nHost: {url.host_port_subcomponent}\r\n"
             f"Content-Length: {length}\r\n"]
    for name, value in headers.items():
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name:
            raise ValueError(f"header {name!r} holds a line break")
        lines.append(f"{name}: {value}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape")
