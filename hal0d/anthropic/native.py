"""The transform of a native Anthropic slot: the upstream speaks the Messages API itself, so its
bytes go to the client exactly as they came (pure).

hal0d writes a frame of its own only where a stream ends badly, and it is the one the translator
writes in the same place: one `event: error` (after a blank line, in case the upstream stopped in
the middle of a line), no `content_block_stop` or `message_stop`, so the anthropic SDK raises
instead of handing back a truncated message as a whole one. A stream the upstream closed without
`message_stop` ends the same way.

One frame is rewritten, and only in one case: a route handed the request on to a native slot
after hal0d had already sent the client its own `message_start` (a keepalive's opening, on a
translating slot before it). A second `message_start` would be a second message to a strict
client, so the upstream's becomes a `message_delta` carrying its usage (the upstream's own count
of the prompt, which the anthropic SDK takes over message_start's), and every later byte passes
as it came. Only the stream's first event is looked at: the bytes before its end are held, never
more than FIRST_EVENT_LIMIT, and the upstream's comment lines before it pass at once.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

from hal0d.anthropic.stream import encode_events
from hal0d.errors import ErrorCode
from hal0d.protocol.transform import STALL_KEY, PureTail, StallTrip, TransformFailed

__all__ = ["NativeAfterOpening", "NativeAnthropic"]

_MESSAGE_STOP = b"event: message_stop"
# How much of a stream's opening is held to find its first event's end (a message_start is a few
# hundred bytes): an upstream that sends more without one is passed on as it came.
FIRST_EVENT_LIMIT = 64 * 1024
_LINE_END = re.compile(rb"\r\n|\r|\n")


def error_frame(message: str, error_type: str = "api_error") -> bytes:
    error = {"type": "error", "error": {"type": error_type, "message": message}}
    return b"\n\n" + encode_events([("error", error)])


class NativeAnthropic(PureTail):
    __slots__ = ()

    @property
    def done(self) -> bool:
        return _MESSAGE_STOP in self._tail or b'"type":"message_stop"' in self._tail

    def complete(self) -> bool:
        return self.done

    def end(self) -> bytes:
        if self.done:
            return b""
        raise TransformFailed(
            ErrorCode.UPSTREAM_INCOMPLETE,
            error_frame("upstream ended the stream without message_stop"),
        )

    def stalled(self, trip: StallTrip) -> bytes:
        if self.done:
            return b""
        details = orjson.dumps({STALL_KEY: trip.details()}).decode()
        return error_frame(f"{trip.notice()} {details}")

    def broken(self, message: str) -> bytes:
        return b"" if self.done else error_frame(message)


def first_block(data: bytes) -> tuple[int, list[bytes]] | None:
    """The end of `data`'s first block of lines (after the blank line that ends it) and its
    lines, or None while it is not complete (a CR last may be half a CRLF). Lines end at CR, LF
    and CRLF, as every event-stream reader cuts them (protocol/sse.py)."""
    lines: list[bytes] = []
    start = 0
    for end in _LINE_END.finditer(data):
        if end.group() == b"\r" and end.end() == len(data):
            return None
        line = data[start:end.start()]
        if not line:
            return end.end(), lines
        lines.append(line)
        start = end.end()
    return None


def usage_delta(lines: list[bytes]) -> bytes | None:
    """For the block `lines` when it is a message_start: a message_delta with its usage (b""
    when it carries none to keep); None for any other event."""
    data = b"\n".join(line[6:] if line[5:6] == b" " else line[5:]
                      for line in lines if line.startswith(b"data:"))
    try:
        payload = orjson.loads(data) if data else None
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict) or payload.get("type") != "message_start":
        return None
    message = payload.get("message")
    usage = message.get("usage") if isinstance(message, dict) else None
    if not isinstance(usage, dict):
        return b""
    counts: dict[str, Any] = {**usage, "output_tokens": usage.get("output_tokens") or 0}
    return encode_events([("message_delta", {
        "type": "message_delta", "delta": {"stop_reason": None, "stop_sequence": None},
        "usage": counts})])


class NativeAfterOpening(NativeAnthropic):
    """A native slot's stream after hal0d's own message_start went out (the module's
    docstring): its first event, a message_start, becomes a message_delta with its usage."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        super().__init__()
        self._held: bytes | None = b""  # None once the first event has passed

    def feed(self, chunk: bytes) -> bytes:
        if self._held is None:
            return super().feed(chunk)
        held, out = self._held + chunk, b""
        while (block := first_block(held)) is not None:
            end, lines = block
            if lines and not all(line.startswith(b":") for line in lines):
                rewritten = usage_delta(lines)
                out += held[:end] if rewritten is None else rewritten
                self._held = None
                return super().feed(out + held[end:])
            out, held = out + held[:end], held[end:]  # comments (or a stray blank line) pass
        if len(held) > FIRST_EVENT_LIMIT:
            self._held = None
            return super().feed(out + held)
        self._held = held
        return super().feed(out) if out else b""

    def end(self) -> bytes:
        # Bytes still held are a first event the upstream never finished: no message_stop can
        # follow, so the stream ends in the error frame, as any stream without one does.
        self._held = None
        return super().end()
