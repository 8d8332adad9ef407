"""The upstream boundary: the one client (UpstreamClient, over one ClientSession), its timeouts,
header filtering and the eager open. What a failed call means is failures.py's, the one module
that names aiohttp's exceptions: hal0d's error for it (`upstream_errors`), and the one retry of a
request a kept-alive connection lost (`retry_on_fresh`, this session's middleware).

Every call hal0d makes to a slot's server goes through `UpstreamClient`: a request's forward
(`open`, then the relay or `read_whole`), and hal0d's own questions (`ask`: the health probe, a
token count, the Anthropic-mode probe, /props, a prompt cache's save and restore).

Bounds of hal0d's own questions. What a server says about itself is read into memory, so it is
read a piece at a time up to a bound (`OWN_ANSWER_LIMIT`, or the caller's): a server that says
more is refused with `upstream.answer_too_large` and the question fails as an answer that was
not usable (UpstreamInvalid), instead of hal0d's memory growing with whatever it is sent (the
timeout bounds such a body only by bandwidth).

Timeouts. aiohttp's client default is total=300 s, which silently kills long streams; the session
has no total. `connect_timeout_s` bounds getting a connection (the name's resolution and the TCP
connect), `write_timeout_s` every wait while the request's body is sent (aiohttp has no write
timeout: the body is written by `_Body`, a piece at a time, each piece's wait bounded, so a slow
but moving upload is not cut and an upstream that takes none of it is), `direct_read_timeout_s`
the wait for response headers (counted from the request's body written) and, unless the stall
guard owns the body, every body read; a stream's open as a whole is bounded by the sum of the
three (UpstreamClient.open), and a whole answer, open and body, by that sum and
`direct_read_timeout_s` once more, with aiohttp's own `total` (no timer of ours: it would be a
second one per request). `pool_timeout_s` bounds nothing: the pool has no connection limit, so
no request ever waits for a connection (a request waits for its slot instead, in the slot's
queue); the config refuses any value but its default. When the stall guard owns a stream's body,
the per-read timeout that bounded its header wait is switched off once the headers are in
(`hand_body_to_guard`). (An earlier design moved a deadline along with aiohttp's tracing signals
instead: four signals a request, ~6% of a stream's CPU and of its time to first byte, for a
bound that differs only while the request is being written.)

Encodings. hal0d reads every answer it relays (a whole answer's usage, the metrics tap of a
stream, the translated surfaces), so it asks every upstream for `Accept-Encoding: identity`
whatever the client accepts (without it aiohttp would offer gzip and deflate, and nginx in front
of a llama-server compresses). The session does not decompress: bytes are relayed as they came,
so an upstream that compresses anyway has its Content-Encoding relayed with them, and the client
can still read them.

Every upstream call goes through this session, streamed or whole, http or https: one pool, the
same bounds whatever the URL's scheme, and aiohttp's own framing rules (a HEAD's answer has no
body, whatever its Content-Length says).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping, MutableMapping
from typing import Any

import aiohttp
from aiohttp import hdrs, payload
from aiohttp.abc import AbstractStreamWriter
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from hal0d import USER_AGENT
from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.errors import UpstreamInvalid
from hal0d.logs import get_logger

# BODY_BROKEN moved to failures.py with every other aiohttp exception; the forward path and the
# lifecycle's remote slots import it from here, so it stays importable from this module too.
from hal0d.transport.failures import BODY_BROKEN as BODY_BROKEN  # noqa: PLC0414 (a re-export)
from hal0d.transport.failures import UpstreamRequest, WriteTimeout, retry_on_fresh, upstream_errors

log = get_logger()

# The most of an answer hal0d reads for itself (what a server says about itself: a few KiB of
# JSON, a llama-server's chat template included); more is refused, not buffered.
OWN_ANSWER_LIMIT = 4 * 2**20
# The piece an own answer is read in.
OWN_ANSWER_PIECE = 2**16

# RFC 9110 7.6.1 hop-by-hop headers, plus the ones aiohttp recomputes for each side.
HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        hdrs.CONNECTION,
        hdrs.KEEP_ALIVE,
        hdrs.PROXY_AUTHENTICATE,
        hdrs.PROXY_AUTHORIZATION,
        hdrs.TE,
        hdrs.TRAILER,
        hdrs.TRANSFER_ENCODING,
        hdrs.UPGRADE,
        "proxy-connection",
        hdrs.HOST,
        hdrs.CONTENT_LENGTH,
    )
)
# Never sent upstream: the client's credentials (the slot's own key is injected instead), and
# its Accept-Encoding: hal0d reads the answer, so it asks for IDENTITY itself (request_headers).
DROP_REQUEST = HOP_BY_HOP | {
    hdrs.AUTHORIZATION.lower(),
    "x-api-key",
    hdrs.ACCEPT_ENCODING.lower(),
    hdrs.COOKIE.lower(),
}
# Not copied back: aiohttp writes its own framing, date and server headers. Content-Encoding is
# copied: the session does not decompress, so it describes the bytes relayed with it.
DROP_RESPONSE = HOP_BY_HOP | {hdrs.DATE.lower(), hdrs.SERVER.lower()}
# What every request to an upstream accepts: uncompressed bytes, which hal0d can read. Named
# explicitly: a request without Accept-Encoding gets aiohttp's own "gzip, deflate".
IDENTITY = "identity"


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Headers named in Connection are hop-by-hop too (RFC 9110 7.6.1)."""
    value = headers.get(hdrs.CONNECTION, "")
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def _without(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    """A copy of `headers` without the names in `drop` (lower case; the multidict compares
    names case-insensitively) nor those their Connection header names: a copy and a few
    deletions, in C, rather than a filter of every header in Python."""
    named = _connection_tokens(headers)
    # Most name nothing or only keep-alive (dropped anyway): no new set per request.
    if not named <= drop:
        drop = drop | named
    out = headers.copy()
    for name in drop:
        if name in out:
            del out[name]
    return out


def request_headers(client: CIMultiDictProxy[str], slot: SlotConfig) -> CIMultiDict[str]:
    out = _without(client, DROP_REQUEST)
    # A client's own User-Agent goes through, as proxies keep it: the upstream's logs and
    # per-client behaviour see the real client. Without one, the request is hal0d's.
    if hdrs.USER_AGENT not in out:
        out[hdrs.USER_AGENT] = USER_AGENT
    out[hdrs.ACCEPT_ENCODING] = IDENTITY
    authorize(out, slot)
    return out


def authorize(headers: MutableMapping[str, str], slot: SlotConfig) -> None:
    """The slot's own key, when it has one, as the bearer token of a request to it."""
    token = slot.bearer_token()
    if token:
        headers[hdrs.AUTHORIZATION] = f"Bearer {token}"


def own_headers(slot: SlotConfig) -> dict[str, str]:
    """The headers of a request hal0d makes on its own account (a probe, a token count)."""
    headers: dict[str, str] = {hdrs.USER_AGENT: USER_AGENT, hdrs.ACCEPT_ENCODING: IDENTITY}
    authorize(headers, slot)
    return headers


# Proxies and browsers must not hold a stream back, nor compress it.
SSE_UNBUFFERED = {hdrs.CACHE_CONTROL: "no-cache", "X-Accel-Buffering": "no"}
# The headers of an event stream hal0d writes itself (a translated surface, the event feed).
SSE_HEADERS = {hdrs.CONTENT_TYPE: "text/event-stream; charset=utf-8", **SSE_UNBUFFERED}
# The headers of the Ollama API's stream: one JSON object a line.
NDJSON_HEADERS = {hdrs.CONTENT_TYPE: "application/x-ndjson", **SSE_UNBUFFERED}


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    out = _without(upstream, DROP_RESPONSE)
    if out.get(hdrs.CONTENT_TYPE, "").startswith("text/event-stream"):
        out.update(SSE_UNBUFFERED)
    return out


@functools.lru_cache(maxsize=256)
def client_timeout(
    timeouts: DispatcherConfig, sock_read: float | None = None, total: float | None = None
) -> aiohttp.ClientTimeout:
    """aiohttp's timeouts from ours: getting a connection (`connect`: the name's resolution and
    the connect; the pool never makes it wait), `sock_read` for every read when given, and
    `total` only for a whole answer (aiohttp's default of 300 s would kill long streams).
    Cached: a slot's timeouts change only on a reload, and the values are frozen."""
    return aiohttp.ClientTimeout(
        total=total,
        connect=timeouts.connect_timeout_s,
        sock_connect=timeouts.connect_timeout_s,
        sock_read=sock_read,
    )


# An idle keep-alive connection older than this is closed instead of reused: servers close idle
# connections after a few seconds (uvicorn after 5 s), and a request written to one the server
# is closing at that instant is lost. aiohttp's own default keeps them 15 s.
KEEPALIVE_S = 4.0


# The most of a body written before its wait for the socket: aiohttp's writer drains (waits for
# the upstream to take what is buffered) once more than 64 KiB are buffered.
BODY_PIECE = 2**16


class _Body(payload.BytesPayload):
    """A request's body, written a piece at a time with each wait for the socket bounded by
    `write_timeout_s`: aiohttp bounds no write of its own. A bound on every wait, not on the
    whole: a large body to a distant upstream over a slow link keeps moving and is not cut.
    Reusable, as the bytes are: a retry sends it again."""

    def __init__(self, value: bytes, write_timeout_s: float) -> None:
        super().__init__(value)
        self.write_timeout_s = write_timeout_s

    async def write(self, writer: AbstractStreamWriter) -> None:
        await self.write_with_length(writer, None)

    async def write_with_length(self, writer: AbstractStreamWriter,
                                content_length: int | None) -> None:
        data = memoryview(self._value)[:content_length]
        for start in range(0, len(data), BODY_PIECE):
            try:
                async with asyncio.timeout(self.write_timeout_s):
                    await writer.write(data[start:start + BODY_PIECE])
            except TimeoutError:
                # Raised into aiohttp's body writer, which hands a timeout on as it is: the
                # response's wait ends with it (a 502 saying so), and the connection is closed.
                raise WriteTimeout(
                    f"the upstream took none of the request for {self.write_timeout_s} s"
                ) from None


def make_session(timeouts: DispatcherConfig) -> aiohttp.ClientSession:
    """The one upstream session: forwarded requests (streamed and whole), probes, token counts."""
    return aiohttp.ClientSession(
        timeout=client_timeout(timeouts),
        request_class=UpstreamRequest,
        middlewares=(retry_on_fresh,),
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300,
                                       keepalive_timeout=KEEPALIVE_S),
        # One session serves every client: a cookie an upstream sets is the client's (relayed to
        # it), never kept here to go out again on someone else's request. No jar, no cost.
        cookie_jar=aiohttp.DummyCookieJar(),
        auto_decompress=False,
        # readany() hands the relay what arrived, up to this much: 64 KiB reads keep per-read
        # latency low and memory per open stream small (1,000 streams: ~28 KB each).
        read_bufsize=2**16,
        trust_env=False,
        # No default headers: every request names its User-Agent (request_headers, own_headers),
        # so aiohttp has nothing to merge into each one.
    )


@functools.lru_cache(maxsize=1024)
def upstream_url(base: str, path: str) -> URL:
    """The parsed URL of `path` on an upstream: aiohttp parses a string on every request, and
    the pairs repeat (a few slots, a few endpoints). Bounded: a path that names a client's id
    (a stored response) only takes one of the places."""
    return URL(base + path)


def open_bound(timeouts: DispatcherConfig) -> float:
    """The most an open may take: the connect, the write, the headers."""
    return (timeouts.connect_timeout_s + timeouts.write_timeout_s
            + timeouts.direct_read_timeout_s)


def hand_body_to_guard(upstream: aiohttp.ClientResponse) -> None:
    """The per-read timeout that bounded the header wait, off for the body: the stall guard
    bounds a stream's reads with its own bounds (a model may think longer than a header wait
    may take). start_timeout() re-arms with none, which cancels the timer the headers' read
    left running."""
    connection = upstream.connection
    if connection is not None and connection.protocol is not None:
        connection.protocol.read_timeout = None
        connection.protocol.start_timeout()


async def read_whole(upstream: aiohttp.ClientResponse, slot: SlotConfig,
                     timeout_s: float | None) -> bytes:
    """A whole body (empty for a HEAD). `timeout_s` bounds it when its open did not (a stream's
    answer that is read whole: an error status, a JSON body); None for an answer opened
    `whole`, which aiohttp's total bounds. A reset, a stall or a broken framing is
    UpstreamUnavailable, a clean 502: nothing was sent to the client yet."""
    with upstream_errors(slot, "while sending its answer", logged=True):
        if timeout_s is None:
            return await upstream.read()
        async with asyncio.timeout(timeout_s):
            return await upstream.read()


class UpstreamClient:
    """The one way out to the upstreams, over the one session (make_session)."""

    __slots__ = ("session",)

    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session

    @classmethod
    def create(cls, timeouts: DispatcherConfig) -> UpstreamClient:
        return cls(make_session(timeouts))

    async def close(self) -> None:
        await self.session.close()

    async def open(
        self,
        slot: SlotConfig,
        timeouts: DispatcherConfig,
        *,
        method: str,
        path: str,
        headers: CIMultiDict[str],
        body: bytes,
        guarded: bool = False,
        whole: bool = False,
        params: Any = None,
        slot_reason: str | None = None,
    ) -> aiohttp.ClientResponse:
        """A forwarded request: send it (every wait while its body is written within
        `write_timeout_s`) and wait for the response headers, within `direct_read_timeout_s` of
        the request written, and the whole open within the sum of the three bounds.

        `guarded`: the stall guard owns the body, so the per-read timeout is off for it.
        `whole`: the answer is read whole (read_whole): aiohttp's total bounds the open and the
        body together, by the sum of the open's bound and `direct_read_timeout_s`.
        `slot_reason`: why the slot is in error, if it is; a failed open names it.
        """
        read_s, bound = timeouts.direct_read_timeout_s, open_bound(timeouts)
        sent = self.session.request(  # sent when awaited
            method, upstream_url(slot.upstream, path), params=params,
            data=_Body(body, timeouts.write_timeout_s) if body else body,
            headers=headers, allow_redirects=False,
            timeout=client_timeout(timeouts, read_s, bound + read_s if whole else None),
        )
        with upstream_errors(slot, "waiting for the upstream's response headers",
                             refused_at="upstream_connect", slot_reason=slot_reason,
                             logged=True):
            if whole:
                return await sent
            async with asyncio.timeout(bound):
                upstream = await sent
        if guarded:
            hand_body_to_guard(upstream)
        return upstream

    async def listen(self, slot: SlotConfig, path: str, *, connect_timeout_s: float
                     ) -> aiohttp.ClientResponse:
        """A long-lived GET of hal0d's own (another hal0d's event feed), with the slot's key:
        the response once its headers are in, its body unbounded (the caller bounds each read
        and closes it). No answer is UpstreamUnavailable."""
        with upstream_errors(slot, f"waiting for GET {path}"):
            async with asyncio.timeout(connect_timeout_s):
                return await self.session.get(
                    upstream_url(slot.upstream, path), headers=own_headers(slot),
                    allow_redirects=False, timeout=aiohttp.ClientTimeout(total=None),
                )

    async def ask(
        self,
        slot: SlotConfig,
        method: str,
        path: str,
        *,
        during: str,
        timeout_s: float,
        body: bytes | None = None,
        headers: Mapping[str, str] | None = None,
        refused_at: str | None = None,
        limit: int = OWN_ANSWER_LIMIT,
    ) -> tuple[int, bytes]:
        """A question of hal0d's own (a probe, a token count): with hal0d's own headers and the
        slot's key, the whole answer within `timeout_s`; (status, body). No answer at all is
        UpstreamUnavailable saying why (`during`: what it waited for), or FdExhausted when
        `refused_at` names the step a refused descriptor is counted at. A body over `limit`
        bytes is UpstreamInvalid (read_own); `limit` 0: the status is the whole answer, and
        the body is not read (its connection is closed instead of drained)."""
        sent = own_headers(slot)
        if body is not None:
            sent[hdrs.CONTENT_TYPE] = "application/json"
        sent.update(headers or {})
        with upstream_errors(slot, during, refused_at=refused_at):
            async with asyncio.timeout(timeout_s):
                async with self.session.request(
                    method, upstream_url(slot.upstream, path), data=body, headers=sent,
                    allow_redirects=False,
                ) as answer:
                    return answer.status, await read_own(answer, slot, path, limit)


async def read_own(answer: aiohttp.ClientResponse, slot: SlotConfig, path: str,
                   limit: int) -> bytes:
    """An answer to a question of hal0d's own, read a piece at a time and refused once it is
    over `limit` bytes (a Content-Length over it: before any of it is read)."""
    if limit == 0:
        return b""
    pieces: list[bytes] = []
    size = answer.content_length or 0
    if size <= limit:
        size = 0
        async for piece in answer.content.iter_chunked(OWN_ANSWER_PIECE):
            size += len(piece)
            if size > limit:
                break
            pieces.append(piece)
    if size > limit:
        log.warning("upstream.answer_too_large", slot=slot.name, path=path, limit_bytes=limit)
        error = UpstreamInvalid(f"slot {slot.name!r} answered {path} with more than "
                                f"{limit} bytes")
        error.cause, error.kind = f"answer to {path} over {limit} bytes", "too_large"
        raise error
    return b"".join(pieces)
