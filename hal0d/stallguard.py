"""The stall guard: two bounds on every relayed stream, and the frames that say it tripped.

A chatty upstream that never finishes resets every per-read timer, and a silent one leaves the
client on a socket that never closes. The guard owns the body of a stream instead:
`stream_total_timeout_s` bounds the whole relay (wall clock), `stream_idle_timeout_s` the gap
between two upstream chunks; 0 disables a bound. Both clocks start once response headers arrived.

The watchdog is one `asyncio.timeout` around the relay loop (no polling loop, no thread). It
expires at the total bound; the idle bound is one timer that fires at most once per idle period,
looks at when the read now awaited began, and either re-arms or makes the timeout expire at once.
Per chunk the relay only notes the time, and the clock stops while a chunk is written to the
client, so a slow client is never blamed on the upstream.

Every synthetic frame carries the `x_hal0_stall` marker: the metrics tap recognises it, so it is
never counted as a token or a TTFT sample (see metrics.live.StreamTap.STALL_MARKER).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import orjson

from hal0d.config import DispatcherConfig

STALL_ID = "hal0-stall-guard"
STALL_MARKER = b'"x_hal0_stall"'


@dataclass(frozen=True, slots=True)
class StallTrip:
    reason: str  # total | idle | read | shutdown
    elapsed_s: float
    upstream: str
    total_s: float
    idle_s: float

    def details(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "elapsed_s": round(self.elapsed_s, 3),
            "upstream": self.upstream,
            "stream_total_timeout_s": self.total_s,
            "stream_idle_timeout_s": self.idle_s,
        }

    def notice(self) -> str:
        """The sentence a person reads where the answer stopped."""
        why = {
            "total": f"the stream ran longer than stream_total_timeout_s = {self.total_s:g} s",
            "idle": f"the upstream sent nothing for stream_idle_timeout_s = {self.idle_s:g} s",
            "read": "the upstream connection timed out on a read (direct_read_timeout_s)",
            "shutdown": "hal0d is shutting down",
        }[self.reason]
        return (
            f"[hal0] stall guard: the answer was cut off after {self.elapsed_s:.1f} s because "
            f"{why} (upstream {self.upstream!r}, reason {self.reason})."
        )


def sse_frame(trip: StallTrip, *, legacy_completion: bool, model: str | None) -> bytes:
    """The terminal event for an OpenAI SSE stream, then [DONE].

    It opens with a blank line so it parses as its own event even when the upstream stalled in
    the middle of a `data:` line.
    """
    text = "\n\n" + trip.notice()
    if legacy_completion:
        choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": "length"}
        kind = "text_completion"
    else:
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": text},
            "finish_reason": "length",
        }
        kind = "chat.completion.chunk"
    chunk = {
        "id": STALL_ID,
        "object": kind,
        "created": int(time.time()),
        "model": model or "",
        "choices": [choice],
        "x_hal0_stall": trip.details(),
    }
    return b"\n\ndata: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


def guard_active(timeouts: DispatcherConfig) -> bool:
    return timeouts.stream_total_timeout_s > 0 or timeouts.stream_idle_timeout_s > 0


class StallGuard:
    """The watchdog of one relayed stream. Use `async with guard:` around the relay loop."""

    def __init__(self, timeouts: DispatcherConfig, upstream: str) -> None:
        self.upstream = upstream
        self.total_s = timeouts.stream_total_timeout_s
        self.idle_s = timeouts.stream_idle_timeout_s
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.time()
        total_deadline = self.started + self.total_s if self.total_s > 0 else None
        # The one asyncio.timeout: it expires at the total bound, or at once when the idle
        # check or end_now() decide the stream is over.
        self._timeout = asyncio.timeout_at(total_deadline)
        self._forced_reason: str | None = None
        # When the read now awaited began; None while a chunk is being written to the client.
        self._waiting_since: float | None = None
        self._idle_check: asyncio.TimerHandle | None = None

    async def __aenter__(self) -> Self:
        await self._timeout.__aenter__()
        if self.idle_s > 0:
            self._idle_check = self._loop.call_at(self.started + self.idle_s, self._check_idle)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._idle_check is not None:
            self._idle_check.cancel()
        await self._timeout.__aexit__(exc_type, exc, traceback)

    # Called for every chunk, so they only note the time: no timer is moved per chunk.
    def awaiting_upstream(self) -> None:
        self._waiting_since = self._loop.time()

    def upstream_answered(self) -> None:
        self._waiting_since = None

    def _check_idle(self) -> None:
        """Runs at most once per idle period: trips, or re-arms for the current read."""
        now = self._loop.time()
        since = self._waiting_since
        # A timer may fire up to the loop's clock resolution early: allow a millisecond.
        if since is not None and now - since >= self.idle_s - 0.001:
            self.end_now("idle")
            return
        self._idle_check = self._loop.call_at(
            (now if since is None else since) + self.idle_s, self._check_idle
        )

    def end_now(self, reason: str) -> None:
        """Trip at once with `reason` (idle, a shutdown past its grace): the same exit, the
        same frame."""
        self._forced_reason = reason
        self._timeout.reschedule(self._loop.time())

    def trip(self, reason: str | None = None) -> StallTrip:
        """What tripped: `reason` when given (read), a forced end, or the total bound."""
        if reason is None:
            reason = self._forced_reason or "total"
        return StallTrip(
            reason=reason,
            elapsed_s=self._loop.time() - self.started,
            upstream=self.upstream,
            total_s=self.total_s,
            idle_s=self.idle_s,
        )
