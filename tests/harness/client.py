"""Asking a daemon as its clients do, in-process (a TestServer) or a process (Hal0dProcess): the
request bodies, a chat and its answer, the slots' views and states, a stream as the client saw
it, the event feed and a POSTed stream read by an independent SSE client, and what an SDK read
under its parser."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
import httpx2
import orjson
from aiohttp_sse_client import client as sse_client
from yarl import URL

from tests.harness.daemons import STARTUP_S
from tests.harness.poll import eventually

if TYPE_CHECKING:
    from openai import AsyncOpenAI

CHAT = "/v1/chat/completions"
HI = [{"role": "user", "content": "hi"}]


class Served(Protocol):
    """A daemon the helpers can ask: a TestServer or a Hal0dProcess."""

    def make_url(self, path: str) -> URL: ...


def chat_body(model: str = "chat", *, stream: bool = True, content: str = "hi",
              **extra: Any) -> dict[str, Any]:
    return {"model": model, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


def body(model: str, text: str = "hi", **extra: Any) -> dict[str, Any]:
    """A chat request's body as a client writes it that leaves `stream` unset."""
    return {"model": model, "messages": [{"role": "user", "content": text}], **extra}


async def chat(http: aiohttp.ClientSession, hal0d: Served, model: str,
               **extra: Any) -> tuple[int, Any]:
    """A whole chat: its status and its JSON."""
    async with http.post(hal0d.make_url(CHAT), json=body(model, **extra)) as resp:
        return resp.status, await resp.json()


async def views(http: aiohttp.ClientSession, hal0d: Served) -> dict[str, dict[str, Any]]:
    """GET /api/slots, by slot name."""
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert resp.status == 200
        return {view["name"]: view for view in (await resp.json())["slots"]}


async def state_is(http: aiohttp.ClientSession, hal0d: Served, name: str, state: str,
                   timeout: float = STARTUP_S) -> dict[str, Any]:
    """The view of slot `name` once it is in `state`."""
    async def reached() -> dict[str, Any]:
        view = (await views(http, hal0d))[name]
        assert view["state"] == state, view
        return view

    return await eventually(reached, timeout, f"slot {name} {state}")


async def read_http_chunks(response: aiohttp.ClientResponse) -> list[bytes]:
    """The body as the HTTP chunks it was framed in (chunked transfer encoding boundaries)."""
    chunks: list[bytes] = []
    current = b""
    async for data, end_of_chunk in response.content.iter_chunks():
        current += data
        if end_of_chunk:
            chunks.append(current)
            current = b""
    if current:
        chunks.append(current)
    return chunks


@dataclass
class Stream:
    """What a client saw of one streamed answer."""

    name: str
    data: list[bytes] = field(default_factory=list)  # the `data:` payloads, in order
    raw: bytes = b""
    first_chunk: asyncio.Event = field(default_factory=asyncio.Event)
    ended_at: float = 0.0
    error: str | None = None

    def parse(self) -> None:
        for block in self.raw.replace(b"\r\n", b"\n").split(b"\n\n"):
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    self.data.append(line[5:].strip())

    @property
    def done(self) -> bool:
        return bool(self.data) and self.data[-1] == b"[DONE]"

    def chunks(self) -> list[dict[str, Any]]:
        return [orjson.loads(item) for item in self.data if item != b"[DONE]"]

    def stall(self) -> dict[str, Any] | None:
        chunks = self.chunks()
        return chunks[-1].get("x_hal0_stall") if chunks else None

    def finished_normally(self) -> bool:
        """The upstream's own ending: a finish_reason, then [DONE], no stall-guard frame."""
        chunks = self.chunks()
        return (self.done and self.stall() is None and bool(chunks)
                and chunks[-1]["choices"][0]["finish_reason"] is not None)


async def open_stream(http: aiohttp.ClientSession, url: str, stream: Stream,
                      body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    """POSTs `body` to `url`'s chat completions and reads the answer into `stream`."""
    try:
        async with http.post(f"{url}{CHAT}", json=body, headers=headers) as response:
            assert response.status == 200, await response.text()
            async for data in response.content.iter_any():
                stream.raw += data
                stream.first_chunk.set()
    except aiohttp.ClientError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        stream.ended_at = time.monotonic()
        stream.first_chunk.set()
        stream.parse()


Event = tuple[str, dict[str, Any]]


class _StreamEnded(Exception):
    """aiohttp-sse-client calls on_error when the body ends (then it would reconnect)."""


def _ended() -> None:
    raise _StreamEnded


class Reader:
    """An independent SSE client reading GET /api/events into `events` as they arrive."""

    def __init__(self, http: aiohttp.ClientSession, hal0d: Served,
                 headers: dict[str, str] | None = None) -> None:
        self.events: list[Event] = []
        self.ended = False
        self._source = sse_client.EventSource(
            str(hal0d.make_url("/api/events")), session=http, headers=headers or {},
            on_error=_ended, max_connect_retry=0,
        )
        self._task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async with self._source:
                async for message in self._source:
                    self.events.append((message.type, json.loads(message.data)))
        except _StreamEnded:
            pass
        self.ended = True

    def named(self, name: str) -> list[dict[str, Any]]:
        return [data for event, data in self.events if event == name]

    async def wait_for(self, name: str, what: str, timeout: float = STARTUP_S,
                       **match: Any) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            for data in self.named(name):
                if all(data.get(key) == value for key, value in match.items()):
                    return data
            return None

        return await eventually(found, timeout, what)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def read_independently(
    http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> list[tuple[float, str, dict[str, Any]]]:
    """(seconds since the request, event name, parsed data) per event, read by aiohttp-sse-client
    to the end of the body. It refuses a response that is not 200 text/event-stream."""
    started = time.monotonic()
    out: list[tuple[float, str, dict[str, Any]]] = []
    source = sse_client.EventSource(
        str(url), option={"method": "POST"}, session=http, json=payload,
        headers=dict(headers or {}), on_error=_ended, max_connect_retry=0,
    )
    async with asyncio.timeout(15):
        try:
            async with source:
                async for message in source:
                    assert message.type, f"a frame without an event name: {message!r}"
                    assert message.type == message.message
                    out.append((time.monotonic() - started, message.type, json.loads(message.data)))
        except _StreamEnded:
            pass
    assert out, "the independent SSE client saw no events"
    return out


async def independent_events(http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
                             headers: dict[str, str] | None = None) -> list[Event]:
    return [(name, data) for _, name, data in await read_independently(http, url, payload, headers)]


class Recording(httpx2.AsyncBaseTransport):
    """The SDK's transport, with every read of a response body kept as (seconds since the
    request was sent, bytes)."""

    def __init__(self) -> None:
        self._inner = httpx2.AsyncHTTPTransport()
        self.reads: list[tuple[float, bytes]] = []

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        started = time.monotonic()
        response = await self._inner.handle_async_request(request)
        reads = self.reads
        assert isinstance(response.stream, httpx2.AsyncByteStream)
        inner: httpx2.AsyncByteStream = response.stream

        class Tee(httpx2.AsyncByteStream):
            async def __aiter__(self) -> AsyncIterator[bytes]:
                async for piece in inner:
                    reads.append((time.monotonic() - started, piece))
                    yield piece

            async def aclose(self) -> None:
                await inner.aclose()

        return httpx2.Response(response.status_code, headers=response.headers, stream=Tee(),
                               extensions=response.extensions)

    async def aclose(self) -> None:
        await self._inner.aclose()

    def received(self) -> bytes:
        """Every byte read so far, the last response's body still coming included."""
        return b"".join(piece for _, piece in self.reads)

    def frames(self) -> list[tuple[float, bytes]]:
        """Each SSE frame the client read (its lines, without the blank line), with the time
        of the read that completed it."""
        out: list[tuple[float, bytes]] = []
        pending = b""
        for at, piece in self.reads:
            pending += piece
            *complete, pending = pending.split(b"\n\n")
            out += [(at, frame) for frame in complete]
        assert pending == b"", f"the body ended inside a frame: {pending[-80:]!r}"
        return out


def openai_sdk(server: Served) -> AsyncOpenAI:
    """The official openai SDK pointed at `server`, imported here: importing it costs about a
    second at collection."""
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0,
                       timeout=10.0)
