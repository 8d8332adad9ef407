"""The transform of a native Anthropic slot: the upstream speaks the Messages API itself, so its
bytes go to the client exactly as they came (pure).

hal0d writes a frame of its own only where a stream ends badly, and it is the one the translator
writes in the same place: one `event: error` (after a blank line, in case the upstream stopped in
the middle of a line), no `content_block_stop` or `message_stop`, so the anthropic SDK raises
instead of handing back a truncated message as a whole one. A stream the upstream closed without
`message_stop` ends the same way.
"""

from __future__ import annotations

import orjson

from hal0d.anthropic.stream import encode_events
from hal0d.errors import ErrorCode
from hal0d.protocol.transform import STALL_KEY, PureTail, StallTrip, TransformFailed

__all__ = ["NativeAnthropic"]

_MESSAGE_STOP = b"event: message_stop"


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
