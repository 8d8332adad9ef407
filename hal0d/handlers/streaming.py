"""What both surfaces do around the relay: a stall guard registered for shutdown, a metrics tap,
and the outcome written into the request's info on every exit, cancellation included."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import aiohttp
from aiohttp import web

from hal0d.appkeys import STREAMS
from hal0d.config import DispatcherConfig
from hal0d.errors import ErrorCode
from hal0d.metrics.live import StreamTap
from hal0d.relay import Outcome, client_gone, relay
from hal0d.requestinfo import INFO, RequestInfo
from hal0d.stallguard import StallGuard
from hal0d.transform import Transform


async def stream_through(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    transform: Transform,
    *,
    timeouts: DispatcherConfig,
    slot_name: str,
) -> None:
    info = request[INFO]
    try:
        await response.prepare(request)
    except ConnectionResetError:
        # The client left as the upstream answered; aiohttp's finish quietly ignores the rest.
        info.fail(ErrorCode.CLIENT_DISCONNECT)
        return
    # Tokens are only in event streams; an audio body would be searched for them to no end.
    tap = StreamTap(info.started) if upstream.content_type == "text/event-stream" else None
    guard = StallGuard(
        timeouts, slot_name, reader=upstream.content, abort_client=abort_client(request)
    )
    streams = request.app[STREAMS]
    streams.add(guard)
    outcome = None
    try:
        outcome = await relay(upstream, response, transform, guard, tap)
    except asyncio.CancelledError:
        if transform.complete():
            # The client had the whole answer and closed before the upstream ended its body,
            # as the openai SDK does on reading [DONE]: a finished request, not a disconnect.
            info.answered = True
        else:
            # The client went away while a write waited, or the guard cut it (the cancellation
            # follows its abort): recorded here, before the middleware's client_disconnect.
            info.fail(client_gone(guard))
        raise
    finally:
        streams.discard(guard)
        record_stream(info, outcome, tap)  # outcome None: cancelled, the client went away


def record_stream(info: RequestInfo, outcome: Outcome | None, tap: StreamTap | None) -> None:
    """What the relay saw, into the request's info; `outcome` is None when the relay did not
    return (cancelled)."""
    if outcome is not None and not outcome.ok and outcome.error_code:
        info.fail(outcome.error_code)
    if tap is None:
        return
    info.ttft_ms = tap.ttft_ms
    info.apply_usage(tap.usage())
    if info.completion_tokens is None:
        info.completion_tokens = tap.completion_tokens()
    info.tokens_per_s = tap.decode_tokens_per_s()


def abort_client(request: web.Request) -> Callable[[], None]:
    def abort() -> None:
        if request.transport is not None:
            request.transport.abort()

    return abort

