"""What a surface plugs into the relay: the Transform protocol and the values that cross it.

The relay (hal0d/transport/relay.py) owns the sockets and the clocks and knows no surface; every
byte it writes to the client comes from a Transform. Each surface brings its own:
hal0d/openai/transform.py passes the upstream's bytes through, hal0d/anthropic/transform.py
translates them. When the stall guard ends a stream it hands the transform a StallTrip, and the
transform renders it in its own surface's frames.

Pure: nothing here imports asyncio or aiohttp (tests/test_purity.py holds it to that), so the
transforms built on it stay testable as "these bytes in, these bytes out".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

__all__ = ["STALL_KEY", "StallTrip", "Transform", "TransformFailed"]

# The key under which every surface's stall frame carries StallTrip.details(); the metrics tap
# looks for it to skip hal0d's own frame (hal0d.transport.stallguard.STALL_MARKER).
STALL_KEY = "x_hal0_stall"


@dataclass(frozen=True, slots=True)
class StallTrip:
    """Why and when the stall guard ended a stream; each surface's transform renders it."""

    reason: str  # total | idle | read | shutdown | unloaded
    elapsed_s: float
    upstream: str  # the slot's name
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
        """The sentence a person reads where the answer stopped: the stall guard's bounds say
        so; a shutdown and a forced unload are no stall and say what they are."""
        cut = f"the answer was cut off after {self.elapsed_s:.1f} s because"
        if self.reason == "shutdown":
            return f"[hal0] {cut} hal0d is shutting down (slot {self.upstream!r})."
        if self.reason == "unloaded":
            return (f"[hal0] {cut} slot {self.upstream!r} was unloaded by force "
                    f"(POST /api/slots/{self.upstream}/unload?force=true).")
        why = {
            "total": f"the stream ran longer than stream_total_timeout_s = {self.total_s:g} s",
            "idle": f"the upstream sent nothing for stream_idle_timeout_s = {self.idle_s:g} s",
            "read": "the upstream connection timed out on a read (direct_read_timeout_s)",
        }[self.reason]
        return (f"[hal0] stall guard: {cut} {why} (upstream {self.upstream!r}, "
                f"reason {self.reason}).")


class TransformFailed(Exception):
    """The transform cannot go on (a malformed upstream chunk); `frame` ends the client stream."""

    def __init__(self, error_code: str, frame: bytes) -> None:
        super().__init__(error_code)
        self.error_code = error_code
        self.frame = frame


class Transform(Protocol):
    """One stream's frames. Each method returns the bytes to write next (b"" for nothing)."""

    def start(self) -> bytes:
        """Before the first upstream chunk is read."""
        ...

    def feed(self, chunk: bytes) -> bytes:
        """One upstream read, as it came. May raise TransformFailed."""
        ...

    def end(self) -> bytes:
        """The upstream closed the body cleanly. May raise TransformFailed."""
        ...

    def stalled(self, trip: StallTrip) -> bytes:
        """The stall guard ended the stream; the last frame the client gets."""
        ...

    def broken(self, message: str) -> bytes:
        """The upstream connection broke mid-body; `message` says how."""
        ...

    def complete(self) -> bool:
        """The client has the whole answer: the stream's terminal frame was written to it (a
        client may close as soon as it reads it, before the upstream ends its body)."""
        ...


# How much of a relayed stream's end a pure transform keeps, to judge how the stream ended.
TAIL_BYTES = 256


class PureTail:
    """The part every pure transform shares (the bytes out exactly as they came in): nothing to
    write first, and the stream's last TAIL_BYTES bytes kept as `_tail`, however the reads cut
    them, for the surface to judge the end by (its `[DONE]`, its `message_stop`). Copies stay
    that small: this runs for every chunk."""

    __slots__ = ("_tail",)

    def __init__(self) -> None:
        self._tail = b""

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: bytes) -> bytes:
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        return chunk
