"""The relay: the one loop that moves a streamed body from the upstream to the client.

Each upstream chunk is handed to a transform and what it returns is written at once (the write is
the backpressure point; nothing is queued). The passthrough transform returns the chunk itself,
so OpenAI streams go through byte for byte; the Anthropic surface plugs in its translating
transform. The stall guard watches the loop, the metrics tap sees every raw chunk.

Every exit is an Outcome: clean end, stall trip, upstream break, client gone. The caller closes
the upstream response in its `finally`, which is what stops an orphaned generation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import aiohttp
import orjson
from aiohttp import web

from hal0d.logs import get_logger
from hal0d.metrics.live import StreamTap
from hal0d.stallguard import StallGuard, StallTrip, StallTripped, sse_frame

log = get_logger()


class TransformFailed(Exception):
    """The transform cannot go on (a malformed upstream chunk); `frame` ends the client stream."""

    def __init__(self, error_code: str, frame: bytes) -> None:
        super().__init__(error_code)
        self.error_code = error_code
        self.frame = frame


class Transform(Protocol):
    def feed(self, chunk: bytes) -> bytes: ...

    def end(self) -> bytes:
        """The upstream closed the body cleanly. May raise TransformFailed."""
        ...

    def stalled(self, trip: StallTrip) -> bytes: ...

    def broken(self, message: str) -> bytes: ...


def error_event(message: str, code: str) -> bytes:
    """An OpenAI-style SSE error event, after a blank line in case a line was left half-written.
    The OpenAI SDKs raise on it, so a cut-off stream is never mistaken for a complete answer."""
    error = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return b"\n\ndata: " + orjson.dumps(error) + b"\n\n"


TAIL_BYTES = 256


class Passthrough:
    """OpenAI surface: bytes out exactly as they came in; frames only for hal0d's own endings.

    The only thing it looks at is the end of a successful SSE stream: one without `data: [DONE]`
    was cut short by the upstream, and the client is told so instead of being left to guess.
    """

    __slots__ = ("_tail", "expect_done", "legacy_completion", "model", "sse")

    def __init__(
        self, *, sse: bool, legacy_completion: bool, model: str | None, expect_done: bool
    ) -> None:
        self.sse = sse
        self.legacy_completion = legacy_completion
        self.model = model
        self.expect_done = expect_done
        self._tail = b""

    def feed(self, chunk: bytes) -> bytes:
        # The stream's last TAIL_BYTES bytes, however the reads cut them; copies stay that small.
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        return chunk

    def end(self) -> bytes:
        if not self.expect_done:
            return b""
        tail = self._tail.rstrip()
        if tail.endswith(b"data: [DONE]") or tail.endswith(b"data:[DONE]"):
            return b""
        message = "the upstream ended the stream without data: [DONE]; the answer may be cut"
        raise TransformFailed(
            "upstream_incomplete", error_event(message, "dispatch.upstream_incomplete")
        )

    def stalled(self, trip: StallTrip) -> bytes:
        if not self.sse:
            return b""  # audio, images: cut off, nothing injected
        return sse_frame(trip, legacy_completion=self.legacy_completion, model=self.model)

    def broken(self, message: str) -> bytes:
        return error_event(message, "dispatch.upstream_broken") if self.sse else b""


@dataclass(slots=True)
class Outcome:
    ok: bool = True
    error_code: str | None = None
    stall: StallTrip | None = None


class _ClientGone(Exception):
    pass


async def _write(response: web.StreamResponse, data: bytes) -> None:
    try:
        await response.write(data)
    except ConnectionResetError:
        raise _ClientGone from None


async def relay(
    upstream: aiohttp.ClientResponse,
    response: web.StreamResponse,
    transform: Transform,
    guard: StallGuard,
    tap: StreamTap | None = None,
) -> Outcome:
    read = upstream.content.readany
    feed = transform.feed
    outcome = Outcome()
    tail = b""
    guard.start()
    try:
        try:
            while True:
                guard.awaiting_upstream()
                chunk = await read()
                if not chunk:
                    break
                guard.upstream_answered()
                if tap is not None:
                    tap.on_chunk(chunk)
                out = feed(chunk)
                if out:
                    await _write(response, out)
            tail = transform.end()
        except StallTripped as exc:
            outcome.stall = guard.trip(exc.reason)
        except aiohttp.ServerTimeoutError:
            # Only possible with both guard bounds 0: the transport's per-read backstop.
            outcome.stall = guard.trip("read")
        except TransformFailed as exc:
            upstream.close()
            outcome.ok, outcome.error_code, tail = False, exc.error_code, exc.frame
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
            upstream.close()
            message = f"upstream {guard.upstream!r} broke the stream: {type(exc).__name__}"
            log.warning("dispatch.upstream_broken", upstream=guard.upstream, error=str(exc))
            outcome.ok, outcome.error_code = False, "upstream_broken"
            tail = transform.broken(message)
        if outcome.stall is not None:
            upstream.close()
            trip = outcome.stall
            log.warning(
                "dispatch.stream_stall_guard_tripped",
                reason=trip.reason,
                elapsed_s=round(trip.elapsed_s, 3),
                upstream=trip.upstream,
            )
            outcome.ok, outcome.error_code = False, f"stream_stall_{trip.reason}"
            tail = transform.stalled(trip)
        # The last writes are watched too: a client that takes nothing is cut, not waited for.
        guard.upstream_answered()
        if tail:
            await _write(response, tail)
        try:
            await response.write_eof()
        except ConnectionResetError:
            raise _ClientGone from None
    except _ClientGone:
        upstream.close()
        outcome.ok = False
        outcome.error_code = "client_stalled" if guard.reason == "client" else "client_disconnect"
    finally:
        guard.stop()
    return outcome
