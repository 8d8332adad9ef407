"""The upstream boundary: the one ClientSession, its timeouts, header filtering, the eager open.

aiohttp's exceptions stop here: a failure to get an HTTP response at all becomes
UpstreamUnavailable (a clean 502 before the client response has started), never a torn stream;
a connect that fails because hal0d has no descriptor left (EMFILE, ENFILE) becomes FdExhausted
(503, see descriptors.py): hal0d's capacity failed, not the upstream.

Timeouts. aiohttp's client default is total=300 s, which silently kills long streams; the session
has no total. `connect_timeout_s` bounds the TCP connect, `pool_timeout_s` the wait for a free
connection, `direct_read_timeout_s` the wait for response headers and, on a non-streaming
request, every body read. When the stall guard owns a stream's body the per-read timeout is off
for that request, and the header wait gets its own deadline instead: a HeaderDeadline, moved by
aiohttp's tracing signals to `write_timeout_s + direct_read_timeout_s` once a connection is had
and to `direct_read_timeout_s` as the request's headers and body go out. (aiohttp signals a body
chunk as it starts writing it, so `write_timeout_s` bounds the request's write only loosely; LLM
request bodies are small and go out in one write.)
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from multidict import CIMultiDict, CIMultiDictProxy

from hal0d import USER_AGENT
from hal0d.appkeys import RUNTIME, SESSION, TOKEN_COUNTER
from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.descriptors import exhausted, exhaustion_errno
from hal0d.errors import UpstreamUnavailable
from hal0d.tokens import TokenCounter

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
# Accept-Encoding so the upstream answers uncompressed bytes we can relay and inspect.
DROP_REQUEST = HOP_BY_HOP | {
    hdrs.AUTHORIZATION.lower(),
    "x-api-key",
    hdrs.ACCEPT_ENCODING.lower(),
    hdrs.COOKIE.lower(),
}
# Not copied back: aiohttp writes its own framing, date and server headers.
DROP_RESPONSE = HOP_BY_HOP | {hdrs.CONTENT_ENCODING.lower(), hdrs.DATE.lower(), hdrs.SERVER.lower()}


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    """Headers named in Connection are hop-by-hop too (RFC 9110 7.6.1)."""
    value = headers.get(hdrs.CONNECTION, "")
    return {token.strip().lower() for token in value.split(",") if token.strip()}


def request_headers(client: CIMultiDictProxy[str], slot: SlotConfig) -> CIMultiDict[str]:
    drop = DROP_REQUEST | _connection_tokens(client)
    out = CIMultiDict((k, v) for k, v in client.items() if k.lower() not in drop)
    # A client's own User-Agent goes through, as proxies keep it: the upstream's logs and
    # per-client behaviour see the real client. Without one, the request is hal0d's.
    if hdrs.USER_AGENT not in out:
        out[hdrs.USER_AGENT] = USER_AGENT
    token = slot.bearer_token()
    if token:
        out[hdrs.AUTHORIZATION] = f"Bearer {token}"
    return out


def response_headers(upstream: CIMultiDictProxy[str]) -> CIMultiDict[str]:
    drop = DROP_RESPONSE | _connection_tokens(upstream)
    out = CIMultiDict((k, v) for k, v in upstream.items() if k.lower() not in drop)
    if out.get(hdrs.CONTENT_TYPE, "").startswith("text/event-stream"):
        # Proxies and browsers must not hold SSE back, nor compress it.
        out[hdrs.CACHE_CONTROL] = "no-cache"
        out["X-Accel-Buffering"] = "no"
    return out


class HeaderDeadline:
    """The deadline of one request's open, moved on as the request gets further."""

    def __init__(self, timeouts: DispatcherConfig) -> None:
        self.timeouts = timeouts
        self._loop = asyncio.get_running_loop()
        # Until a connection is had: pool wait and connect (aiohttp bounds those itself too).
        self.timeout = asyncio.timeout(
            timeouts.pool_timeout_s
            + timeouts.connect_timeout_s
            + timeouts.write_timeout_s
            + timeouts.direct_read_timeout_s
        )

    def connected(self) -> None:
        self.timeout.reschedule(
            self._loop.time() + self.timeouts.write_timeout_s + self.timeouts.direct_read_timeout_s
        )

    def sent(self) -> None:
        self.timeout.reschedule(self._loop.time() + self.timeouts.direct_read_timeout_s)


async def _on_connected(_: Any, context: Any, __: Any) -> None:
    if isinstance(context.trace_request_ctx, HeaderDeadline):
        context.trace_request_ctx.connected()


async def _on_sent(_: Any, context: Any, __: Any) -> None:
    if isinstance(context.trace_request_ctx, HeaderDeadline):
        context.trace_request_ctx.sent()


def header_tracing() -> aiohttp.TraceConfig:
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_on_connected)
    trace.on_connection_reuseconn.append(_on_connected)
    trace.on_request_headers_sent.append(_on_sent)
    trace.on_request_chunk_sent.append(_on_sent)
    return trace


def make_session(timeouts: DispatcherConfig) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        trace_configs=[header_tracing()],
        timeout=aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.pool_timeout_s + timeouts.connect_timeout_s,
            sock_connect=timeouts.connect_timeout_s,
        ),
        connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
        auto_decompress=False,
        # readany() hands the relay what arrived, up to this much: 64 KiB reads keep per-read
        # latency low and memory per open stream small (1,000 streams: ~28 KB each).
        read_bufsize=2**16,
        trust_env=False,
        # Instead of aiohttp's own "Python/3.x aiohttp/3.x", on any request that sets none.
        headers={hdrs.USER_AGENT: USER_AGENT},
    )


async def session_context(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the one shared ClientSession for every upstream call."""
    app[SESSION] = make_session(app[RUNTIME].current.config.dispatcher)
    app[TOKEN_COUNTER] = TokenCounter(app[SESSION])
    yield
    await app[SESSION].close()


async def open_upstream(
    session: aiohttp.ClientSession,
    slot: SlotConfig,
    timeouts: DispatcherConfig,
    *,
    method: str,
    path: str,
    headers: CIMultiDict[str],
    body: bytes,
    guarded: bool,
    params: Any = None,
    slot_reason: str | None = None,
) -> aiohttp.ClientResponse:
    """Send the request and wait for the response headers.

    `guarded`: the stall guard owns the body, so the per-read timeout is off for this request.
    `slot_reason`: why the slot is in error, if it is (a lease is granted in error, as the probe
    may be stale); a failed open names it, since "cannot connect" alone hides the cause (a
    process that could not be started).
    """
    read_timeout = None if guarded else timeouts.direct_read_timeout_s
    deadline = HeaderDeadline(timeouts)
    try:
        async with deadline.timeout:
            return await session.request(
                method,
                slot.upstream + path,
                params=params,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(
                    total=None,
                    connect=timeouts.pool_timeout_s + timeouts.connect_timeout_s,
                    sock_connect=timeouts.connect_timeout_s,
                    sock_read=read_timeout,
                ),
                allow_redirects=False,
                trace_request_ctx=deadline,
            )
    except (TimeoutError, aiohttp.ServerTimeoutError):
        reason = "timed out waiting for the upstream's response headers"
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        if (code := exhaustion_errno(exc)) is not None:
            # hal0d's own capacity failed, not the upstream: a 503 to retry, not a 502.
            raise exhausted(code, "upstream_connect", f"connect to slot {slot.name!r}") from None
        if isinstance(exc, aiohttp.ClientConnectorError):
            reason = f"cannot connect ({exc.os_error.strerror or exc.os_error})"
        else:
            reason = f"{type(exc).__name__}: {exc}"
    if slot_reason:
        reason += f"; the slot is in error: {slot_reason}"
    raise UpstreamUnavailable(f"slot {slot.name!r} at {slot.upstream} is unavailable: {reason}")


async def read_whole(upstream: aiohttp.ClientResponse, slot: str, timeout_s: float) -> bytes:
    """A whole (non-streamed) body within `timeout_s`. A reset, a stall or a broken framing is
    UpstreamUnavailable, a clean 502: nothing was sent to the client yet."""
    try:
        async with asyncio.timeout(timeout_s):
            return await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise UpstreamUnavailable(
            f"slot {slot!r} failed while sending its answer: {type(exc).__name__}"
        ) from None
