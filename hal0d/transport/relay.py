"""The relay: the one loop that moves a streamed body from the upstream to the client.

Each upstream chunk is handed to the stream's transform (hal0d.protocol.transform.Transform) and
what it returns is written at once (the write is the backpressure point; nothing is queued). The
relay knows no surface: every byte it writes comes from the transform, which each surface brings
(hal0d/openai/ passes bytes through, hal0d/anthropic/ translates them). The stall guard watches the
loop, the metrics tap sees every raw chunk.

Every exit is an Outcome: clean end, stall trip, upstream break, client gone. The caller closes
the upstream response in its `finally`, which is what stops an orphaned generation.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from hal0d.errors import ErrorCode, stream_stall
from hal0d.logs import get_logger
from hal0d.protocol.transform import StallTrip, Transform, TransformFailed
from hal0d.transport.failures import BODY_BROKEN, BODY_READ_TIMEOUT
from hal0d.transport.stallguard import StallGuard, StallTripped
from hal0d.transport.tap import StreamTap

log = get_logger()


@dataclass(slots=True)
class Outcome:
    ok: bool = True
    error_code: str | None = None
    stall: StallTrip | None = None


class _ClientGone(Exception):
    pass


def client_gone(guard: StallGuard) -> ErrorCode:
    """How a stream whose client went away is recorded: cut by the guard for taking no bytes
    (client_stalled, whether or not a bound had tripped before), or left on its own
    (client_disconnect)."""
    return ErrorCode.CLIENT_STALLED if guard.client_cut else ErrorCode.CLIENT_DISCONNECT


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        raise _ClientGone from None


async def relay(  # long: the per-chunk loop is written out, not called (the docstring)
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    transform: Transform,
    guard: StallGuard,
    tap: StreamTap | None = None,
    *,
    first_chunk: bytes = b"",
    answered: Callable[[], None] | None = None,
) -> Outcome:
    """The body (after `first_chunk`, read before: a route's first_byte_timeout_s waited for it)
    until it ends, however it ends, then the transform's last frame; the Outcome says how.
    `answered`: told once, when the first chunk is in and before anything of it is written (the
    keepalive writes no more after it). The per-chunk loop is written out, not called: each
    coroutine level is resumed every chunk."""
    outcome = Outcome()
    read, feed, write = upstream.content.readany, transform.feed, response.write
    awaiting_upstream, upstream_answered = guard.awaiting_upstream, guard.upstream_answered
    guard.start()
    try:
        try:
            if first := transform.start():
                upstream_answered()  # a write to the client, watched like the loop's
                await _write(response, first)
            chunk = first_chunk
            if not chunk:
                awaiting_upstream()
                chunk = await read()
            if answered is not None:
                answered()
            while chunk:
                upstream_answered()
                if tap is not None:
                    tap.on_chunk(chunk)
                if out := feed(chunk):
                    try:
                        await write(out)
                    except ConnectionResetError:
                        raise _ClientGone from None
                awaiting_upstream()
                chunk = await read()
            last = transform.end()
        except StallTripped as exc:
            last = _stalled(upstream, transform, outcome, guard.trip(exc.reason))
        except BODY_READ_TIMEOUT:
            # Only possible with both guard bounds 0: the transport's per-read backstop.
            last = _stalled(upstream, transform, outcome, guard.trip("read"))
        except TransformFailed as exc:
            upstream.close()
            outcome.ok, outcome.error_code, last = False, exc.error_code, exc.frame
        except BODY_BROKEN as exc:
            last = _broken(upstream, transform, outcome, guard.upstream, exc)
        # The last writes are watched too: a client that takes nothing is cut, not waited for.
        upstream_answered()
        if last:
            await _write(response, last)
        # A client that leaves after the answer's last byte, before the chunked framing's end
        # (the openai SDK closes its response on its stream's end mark), has the whole answer.
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
    except _ClientGone:
        upstream.close()
        outcome.ok = False
        outcome.error_code = client_gone(guard)
    finally:
        guard.stop()
    return outcome


def _stalled(upstream: aiohttp.ClientResponse, transform: Transform, outcome: Outcome,
             trip: StallTrip) -> bytes:
    upstream.close()
    log.warning(
        "dispatch.stream_stall_guard_tripped",
        reason=trip.reason,
        elapsed_s=round(trip.elapsed_s, 3),
        upstream=trip.upstream,
    )
    outcome.ok, outcome.error_code = False, stream_stall(trip.reason)
    outcome.stall = trip
    return transform.stalled(trip)


def _broken(upstream: aiohttp.ClientResponse, transform: Transform, outcome: Outcome,
            name: str, exc: Exception) -> bytes:
    upstream.close()
    message = f"upstream {name!r} broke the stream: {type(exc).__name__}"
    log.warning("dispatch.upstream_broken", upstream=name, error=str(exc))
    outcome.ok, outcome.error_code = False, ErrorCode.UPSTREAM_BROKEN
    return transform.broken(message)
