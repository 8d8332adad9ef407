"""The Responses API transform of the relay: upstream bytes out as they came, hal0d's own endings
in the Responses API's events (pure).

A Responses stream is named SSE events (`response.created`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.completed`), each with a
`sequence_number`. The bytes pass through untouched; the transform reads the events alongside
only to be able to end the stream the way a Responses client understands:

    stall trip      the open message's text part gets one `response.output_text.delta` with the
                    guard's notice, then `response.incomplete` (`incomplete_details.reason =
                    "max_output_tokens"`, the diagnostic under `x_hal0_stall`): an incomplete
                    answer, which the OpenAI SDK yields without raising
    upstream broke  an `error` event, then `response.failed`; the `error` event also carries an
                    `error` object, which is what makes the OpenAI SDK raise
    no terminal     the upstream closed without `response.completed` / `.incomplete` / `.failed`:
                    ended like a break, so a cut answer never reads as a whole one
    a wait          (`keepalive(what)`, before the upstream's first byte) an SSE comment line,
                    `: hal0d: <what>`, which clients skip

For those endings to be accepted by a client that accumulates the stream (the SDK's
`responses.stream`), hal0d's events continue the upstream's: the same response id, the next
sequence numbers, and a message item and text part opened first when none is open.

State kept while reading:  response (id, model) from `response.created`
                           the open message item and its output_text part, if any
                           the next output index and sequence number
                           whether a terminal event was seen
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from hal0d.errors import ErrorCode
from hal0d.protocol.sse import Decoder, comment
from hal0d.protocol.transform import STALL_KEY, StallTrip, TransformFailed

__all__ = ["TERMINAL_EVENTS", "ResponsesTransform", "failure_events", "response_id_of"]

TERMINAL_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})
# The events whose fields the transform needs; every other event is only counted.
_TRACKED = frozenset({
    "response.created",
    "response.output_item.added",
    "response.output_item.done",
    "response.content_part.added",
    "response.content_part.done",
}) | TERMINAL_EVENTS


E = TypeVar("E")


def failure_events(event: Callable[..., E], response: dict[str, Any], message: str,
                   code: str) -> list[E]:
    """How hal0d ends a Responses stream that cannot end well, here and in the bridge
    (hal0d/openai/responses_bridge.py): an `error` event with the `error` object the OpenAI SDK
    raises on, then `response.failed` carrying `response` with its error. `event(kind,
    **fields)` makes one event and numbers it."""
    error = {"message": message, "type": "upstream_error", "code": f"dispatch.{code}"}
    response["error"] = {"code": "server_error", "message": message}
    return [event("error", code=code, message=message, param=None, error=error),
            event("response.failed", response=response)]


def response_id_of(body: Any) -> str | None:
    """The `id` of a whole (non-streamed) Responses answer, when it is one."""
    if isinstance(body, dict) and body.get("object") == "response":
        given = body.get("id")
        return given if isinstance(given, str) and given else None
    return None


class ResponsesTransform:
    """Passes a Responses stream through; renders hal0d's endings as Responses events."""

    __slots__ = ("_decoder", "_item", "_next_output", "_part", "_sequence", "done", "model",
                 "response_id")

    def __init__(self, *, model: str | None) -> None:
        self.model = model
        self.response_id: str | None = None
        self.done = False
        self._decoder = Decoder()
        self._sequence = 0
        self._next_output = 0
        self._item: tuple[str, int] | None = None  # the open message: (item id, output index)
        self._part: int | None = None  # the open output_text part's content index

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: bytes) -> bytes:
        for event in self._decoder.feed(chunk):
            self._note(event.event, event.data)
        return chunk

    def _note(self, name: str | None, data: str) -> None:
        if name is not None and name not in _TRACKED:
            self._sequence += 1  # a delta: the hot path, never parsed
            return
        try:
            payload = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if not isinstance(payload, dict):
            return
        kind = payload.get("type", name)
        sequence = payload.get("sequence_number")
        self._sequence = sequence + 1 if type(sequence) is int else self._sequence + 1
        if kind in TERMINAL_EVENTS:
            self.done = True
        if kind == "response.created":
            response = payload.get("response")
            if isinstance(response, dict) and isinstance(response.get("id"), str):
                self.response_id = response["id"]
                self.model = response.get("model") or self.model
        elif kind == "response.output_item.added":
            item, index = payload.get("item"), payload.get("output_index")
            if type(index) is int:
                self._next_output = max(self._next_output, index + 1)
                if isinstance(item, dict) and item.get("type") == "message":
                    self._item, self._part = (str(item.get("id", "")), index), None
        elif kind == "response.content_part.added":
            part, index = payload.get("part"), payload.get("content_index")
            if isinstance(part, dict) and part.get("type") == "output_text" and type(index) is int:
                self._part = index
        elif kind == "response.content_part.done":
            self._part = None
        elif kind == "response.output_item.done":
            self._item, self._part = None, None

    def complete(self) -> bool:
        return self.done

    def end(self) -> bytes:
        if self.done:
            return b""
        message = "the upstream ended the Responses stream without response.completed"
        raise TransformFailed(ErrorCode.UPSTREAM_INCOMPLETE,
                              self._failed(message, ErrorCode.UPSTREAM_INCOMPLETE))

    def stalled(self, trip: StallTrip) -> bytes:
        if self.done:
            return b""
        frames = self._opening()
        if self._item is None:
            item_id = f"msg_hal0_{uuid.uuid4().hex[:16]}"
            self._item = (item_id, self._next_output)
            self._next_output += 1
            frames.append(self._event("response.output_item.added", output_index=self._item[1],
                                      item={"id": item_id, "type": "message", "role": "assistant",
                                            "status": "in_progress", "content": []}))
        item_id, output_index = self._item
        if self._part is None:
            self._part = 0
            frames.append(self._event(
                "response.content_part.added", item_id=item_id, output_index=output_index,
                content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        frames.append(self._event(
            "response.output_text.delta", item_id=item_id, output_index=output_index,
            content_index=self._part, delta="\n\n" + trip.notice(), logprobs=[]))
        response = self._response("incomplete")
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        response[STALL_KEY] = trip.details()
        frames.append(self._event("response.incomplete", response=response))
        self.done = True
        return b"\n\n" + b"".join(frames)

    def broken(self, message: str) -> bytes:
        if self.done:
            return b""
        return self._failed(message, ErrorCode.UPSTREAM_BROKEN)

    def keepalive(self, what: str) -> bytes:
        """`: hal0d: <what>`, one comment line; b"" once a terminal event is out."""
        return b"" if self.done else comment(f"hal0d: {what}")

    def _failed(self, message: str, code: str) -> bytes:
        """The failure's events (failure_events), after a blank line in case a line was left
        half-written."""
        frames = self._opening()
        frames += failure_events(self._event, self._response("failed"), message, code)
        self.done = True
        return b"\n\n" + b"".join(frames)

    def _opening(self) -> list[bytes]:
        """A `response.created` of hal0d's own when the upstream never sent one: a client
        accumulating the stream needs it before anything else."""
        if self.response_id is not None:
            return []
        self.response_id = f"resp_hal0_{uuid.uuid4().hex[:16]}"
        return [self._event("response.created", response=self._response("in_progress"))]

    def _response(self, status: str) -> dict[str, Any]:
        # No `output`: a client that accumulated the stream keeps the items it has.
        return {"id": self.response_id, "object": "response", "created_at": int(time.time()),
                "status": status, "model": self.model or "", "error": None,
                "incomplete_details": None}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
