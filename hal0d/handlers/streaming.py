"""What both surfaces do around the relay: a stall guard registered for shutdown, a metrics tap,
and the outcome written into the request's info on every exit, cancellation included."""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web

from hal0d.appkeys import STREAMS
from hal0d.config import DispatcherConfig
from hal0d.metrics.live import StreamTap
from hal0d.relay import relay
from hal0d.requestinfo import INFO
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
        info.fail("client_disconnect")
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
    finally:
        streams.discard(guard)
        if guard.reason == "client":
            info.fail("client_stalled")  # before the cancellation that follows the abort
        info.apply_stream(outcome, tap)  # outcome None: cancelled, the client went away


def abort_client(request: web.Request) -> Callable[[], None]:
    def abort() -> None:
        if request.transport is not None:
            request.transport.abort()

    return abort

