"""The OpenAI transform of the relay: upstream bytes out exactly as they came in (pure).

OpenAI-compatible upstreams already speak the client's protocol, so nothing is parsed on the way.
hal0d writes frames of its own only where a stream ends badly: a `chat.completion.chunk` (or
`text_completion`, for the legacy endpoint) with the stall guard's notice, and an error event when
the upstream broke off or never sent `data: [DONE]`. The OpenAI SDKs raise on the error event, so
a cut-off stream is never mistaken for a complete answer. While a streamed request waits (its
queue, its load, its first token), `keepalive(what)` is an SSE comment saying for what, which
clients skip; the upstream's own comment lines pass through as they came.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from hal0d.errors import ErrorCode
from hal0d.protocol.sse import comment
from hal0d.protocol.transform import STALL_KEY, PureTail, StallTrip, TransformFailed

__all__ = ["STALL_ID", "Passthrough", "error_event", "stall_frame"]

STALL_ID = "hal0-stall-guard"


def error_event(message: str, code: str) -> bytes:
    """An OpenAI-style SSE error event, after a blank line in case a line was left half-written."""
    error = {"error": {"message": message, "type": "upstream_error", "code": code}}
    return b"\n\ndata: " + orjson.dumps(error) + b"\n\n"


def stall_frame(trip: StallTrip, *, legacy_completion: bool, model: str | None) -> bytes:
    """The terminal event for an OpenAI SSE stream the stall guard ended, then [DONE].

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
        STALL_KEY: trip.details(),
    }
    return b"\n\ndata: " + orjson.dumps(chunk) + b"\n\ndata: [DONE]\n\n"


class Passthrough(PureTail):
    """Bytes out exactly as they came in; frames only for hal0d's own endings.

    The only thing it looks at is the end of a successful SSE stream: one without `data: [DONE]`
    was cut short by the upstream, and the client is told so instead of being left to guess.
    """

    __slots__ = ("expect_done", "legacy_completion", "model", "sse")

    def __init__(
        self, *, sse: bool, legacy_completion: bool, model: str | None, expect_done: bool
    ) -> None:
        self.sse = sse
        self.legacy_completion = legacy_completion
        self.model = model
        self.expect_done = expect_done
        super().__init__()

    def complete(self) -> bool:
        tail = self._tail.rstrip()
        return self.expect_done and tail.endswith((b"data: [DONE]", b"data:[DONE]"))

    def end(self) -> bytes:
        if not self.expect_done or self.complete():
            return b""
        message = "the upstream ended the stream without data: [DONE]; the answer may be cut"
        raise TransformFailed(
            ErrorCode.UPSTREAM_INCOMPLETE, error_event(message, "dispatch.upstream_incomplete")
        )

    def stalled(self, trip: StallTrip) -> bytes:
        if not self.sse:
            return b""  # audio, images: cut off, nothing injected
        return stall_frame(trip, legacy_completion=self.legacy_completion, model=self.model)

    def broken(self, message: str) -> bytes:
        return error_event(message, "dispatch.upstream_broken") if self.sse else b""

    def keepalive(self, what: str) -> bytes:
        """`: hal0d: <what>`, one comment line; b"" for a body that is not SSE."""
        return comment(f"hal0d: {what}") if self.sse else b""
