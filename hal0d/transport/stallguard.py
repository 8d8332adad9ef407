"""The stall guard: two bounds on every relayed stream, and the StallTrip that says it tripped.

A chatty upstream that never finishes resets every per-read timer, and a silent one leaves the
client on a socket that never closes. The guard owns the body of a stream instead:
`stream_total_timeout_s` bounds the whole relay (wall clock), `stream_idle_timeout_s` the gap
between two upstream chunks; 0 disables a bound. Both clocks start once response headers arrived.

The watchdog is one event-loop timer per stream (no polling loop, no thread): it fires at most
once per idle period, and at the total deadline, looks at when the read now awaited began, and
either re-arms or trips. Per chunk the relay only notes the time, and the idle clock stops while
a chunk is written to the client, so a slow client is never blamed on the upstream.

A trip fails the upstream read (StreamReader.set_exception) instead of cancelling the relay's
task, as asyncio.timeout would: a cancellation that lands while a write waits for the client
to drain leaves aiohttp's response writer holding a cancelled future, and the terminal frame and
the request's record are lost with it. Failing the read is deterministic: the relay sees
StallTripped at its next read, whatever it was doing when the bound ran out.

A check that runs late (the loop was away: a long callback, a collection, a starved process)
may find a bound run out while what the upstream sent meanwhile is still unread in the socket,
or a drained write not yet seen by the relay: the event loop runs due timers before the reads
that arrived in the same turn reach the relay. Such a check gives the read or write one more look,
as long again as the loop was away (at most one bound), before it calls it a stall; once per read
or write, so a loop that is always late still trips, by at most that much later.

A client that takes no bytes for `max(stream_idle_timeout_s, direct_read_timeout_s)` is cut too
(its connection aborted, error_code client_stalled): otherwise a client that stops reading but
keeps its socket open would hold a slot and an upstream generation for as long as it likes.

The guard knows no surface: it hands the relay a StallTrip (reason, elapsed time, slot, the
notice a person reads), and the stream's transform renders it as its own surface's last frame.
That frame is written by the relay after the loop and never passes through the metrics tap, so it
is never counted as a token or a TTFT sample; its STALL_MARKER also lets the tap skip it should a
hal0d stand in front of another hal0d.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from hal0d.config import DispatcherConfig
from hal0d.logs import get_logger
from hal0d.protocol.transform import STALL_KEY, StallTrip

log = get_logger()

# A check this late after its due time ran after the loop was away (see the module's text).
LATE_S = 0.01

# What the metrics tap looks for to skip the stall frame of a hal0d standing upstream of this one.
STALL_MARKER = f'"{STALL_KEY}"'.encode()


def guard_active(timeouts: DispatcherConfig) -> bool:
    return timeouts.stream_total_timeout_s > 0 or timeouts.stream_idle_timeout_s > 0


class StallTripped(Exception):
    """Raised by the upstream read of a stream the guard ended."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Reader(Protocol):
    def set_exception(self, exc: BaseException) -> None: ...


def client_bound_s(timeouts: DispatcherConfig) -> float:
    """How long a client of hal0d may sit on a full socket before it is cut: a relayed stream's
    (this guard's) and the event feed's alike, so one setting says it for every client."""
    return max(timeouts.stream_idle_timeout_s, timeouts.direct_read_timeout_s)


class StallGuard:
    """The watchdog of one relayed stream: start() before the relay loop, stop() after it."""

    def __init__(
        self,
        timeouts: DispatcherConfig,
        upstream: str,
        reader: Reader,
        abort_client: Callable[[], None],
    ) -> None:
        self.upstream = upstream
        self.total_s = timeouts.stream_total_timeout_s
        self.idle_s = timeouts.stream_idle_timeout_s
        self.client_s = client_bound_s(timeouts)
        self._reader = reader
        self._abort_client = abort_client
        self._loop = asyncio.get_running_loop()
        self.started = self._loop.time()
        self.reason: str | None = None  # why the stream was ended, once it was
        # The client's connection was cut for taking no bytes (after a trip too: a relay blocked
        # in a write never sees the trip, and the client never gets its frame).
        self.client_cut = False
        # When the read now awaited began; None while a chunk is written to the client.
        self._reading_since: float | None = None
        # When the write now awaited began; None while the upstream is awaited.
        self._writing_since: float | None = None
        self._check_timer: asyncio.TimerHandle | None = None
        # The read or write (its start) that a late check gave one more look.
        self._second_look: float | None = None

    def start(self) -> None:
        self._arm(self.started + (self.idle_s or self.client_s))

    def stop(self) -> None:
        if self._check_timer is not None:
            self._check_timer.cancel()

    def _arm(self, due: float) -> None:
        """The next check at `due`, or at the total deadline if that comes first (once the
        stream has been ended, only a stalled client is still looked for)."""
        if self.total_s > 0 and self.reason is None:
            due = min(due, self.started + self.total_s)
        self._check_timer = self._loop.call_at(due, self._check)

    def _look_again(self, since: float, now: float, bound: float) -> bool:
        """Whether a late check (the one running now) re-armed for one more look at the read or
        write begun at `since`, under `bound`, instead of ending it (see the module's text)."""
        assert self._check_timer is not None  # the check that runs was armed
        away = now - self._check_timer.when()
        if away <= LATE_S or self._second_look == since:
            return False
        self._second_look = since
        self._arm(now + min(away, bound))
        return True

    # Called for every chunk, so they only note the time: no timer is moved per chunk.
    def awaiting_upstream(self) -> None:
        self._reading_since = self._loop.time()
        self._writing_since = None

    def upstream_answered(self) -> None:
        self._reading_since = None
        self._writing_since = self._loop.time()

    def _check(self) -> None:
        """Runs at most once per bound: trips, or re-arms for the read or write now awaited."""
        now = self._loop.time()
        reading, writing = self._reading_since, self._writing_since
        # A timer may fire up to the loop's clock resolution early: allow a millisecond.
        if self.total_s > 0 and now - self.started >= self.total_s - 0.001:
            self.end_now("total")  # a write that waits on the client is still watched below
        if reading is not None and self.idle_s > 0 and now - reading >= self.idle_s - 0.001:
            if not self._look_again(reading, now, self.idle_s):
                self.end_now("idle")
            return
        if writing is not None and now - writing >= self.client_s - 0.001:
            if self._look_again(writing, now, self.client_s):
                return
            self.reason = self.reason or "client"
            self.client_cut = True
            log.warning(
                "dispatch.client_stalled", upstream=self.upstream, waited_s=round(now - writing, 3)
            )
            self._abort_client()  # the blocked write fails, the handler is cancelled
            return
        if reading is not None and self.idle_s > 0:
            due = reading + self.idle_s
        elif writing is not None:
            due = writing + self.client_s
        else:
            due = now + (self.idle_s or self.client_s)
        self._arm(due)

    def end_now(self, reason: str) -> None:
        """End the stream with `reason` (total, idle, a shutdown past its grace): its next
        upstream read raises StallTripped."""
        if self.reason is None:
            self.reason = reason
            self._reader.set_exception(StallTripped(reason))

    def trip(self, reason: str) -> StallTrip:
        return StallTrip(
            reason=reason,
            elapsed_s=self._loop.time() - self.started,
            upstream=self.upstream,
            total_s=self.total_s,
            idle_s=self.idle_s,
        )
