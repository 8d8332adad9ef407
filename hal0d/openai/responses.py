"""The Responses API transform of the relay: the upstream's events out as they came (or, from a
server that leaves their indices out, with them filled in), hal0d's own endings in the Responses
API's events (pure).

A Responses stream is named SSE events (`response.created`, `response.output_item.added`,
`response.content_part.added`, `response.output_text.delta`..., `response.completed`), each with a
`sequence_number`, and each event about an output item with its `output_index` (and, within a
message, the part's `content_index`): a client that accumulates the stream (the OpenAI SDK's
`responses.stream`) files every delta by them. The first event says which of two streams this is:

    numbered    (vLLM, OpenAI) it carries `sequence_number`: the bytes pass through untouched and
                the transform reads the events alongside, parsing only the few it tracks
    unnumbered  (llama-server) it does not: each event is written again as it is read, with
                what it lacks supplied (`fill`): the next `sequence_number`; the `output_index`
                its item got when added (by item id; a new item the next index); the
                `content_index` of the item's part (counted by `content_part.added`); an output
                text's empty `logprobs` and `annotations`; and on `response.created` and
                `.in_progress` the `created_at`, `model` and empty `output` its response left out.
                A comment line (llama-server's keepalive while it reads a prompt) stays one.

Until the first event is whole, the comment lines before it go out as they came and the rest is
held (never more than that one event). The transform also ends a stream the way a Responses client
understands:

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

For those endings to be accepted by a client that accumulates the stream, hal0d's events continue
the upstream's: the same response id, the next sequence numbers, and a message item and text part
opened first when none is open.

State kept while reading:  which stream this is (None until its first event), and that event's
                           bytes while it is incomplete
                           response (id, model) from `response.created`
                           the open message item and its output_text part, if any
                           the next output index and sequence number
                           unnumbered: each item's output index and count of parts, by item id
                           whether a terminal event was seen
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from hal0d.errors import ErrorCode
from hal0d.protocol.sse import COMMENT, Decoder, Event, comment, frame
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
# Of an unnumbered stream: the events whose response is the answer so far (not its end) ...
_LIFECYCLE = frozenset({"response.created", "response.queued", "response.in_progress"})
# ... those that name a part of their item by `content_index` (OpenAI's schema) ...
_IN_A_PART = frozenset({
    "response.content_part.done",
    "response.output_text.delta",
    "response.output_text.done",
    "response.output_text.annotation.added",
    "response.refusal.delta",
    "response.refusal.done",
    "response.reasoning_text.delta",
    "response.reasoning_text.done",
})
# ... and those that carry the text's `logprobs` (the SDK reads them off every one).
_WITH_LOGPROBS = frozenset({"response.output_text.delta", "response.output_text.done"})
_PING = comment("")

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


def _field_start(data: bytes, *, in_line: bool) -> int:
    """Where the first line of `data` that is an event's field (`event:`, `data:`...) begins, -1
    when none does: what comes before it is comment lines and blank lines. `in_line`: `data`
    goes on with a (comment) line the previous read began."""
    at, size = 0, len(data)
    while at < size:
        if not in_line and data[at] not in b"\r\n:":
            return at
        breaks = [found for found in (data.find(b"\n", at), data.find(b"\r", at)) if found >= 0]
        if not breaks:
            return -1
        at, in_line = min(breaks) + 1, False
    return -1


def _numbered(data: str) -> bool:
    """A stream's first event carries its `sequence_number` (what is no Responses event at all
    is passed on as it came)."""
    try:
        payload = orjson.loads(data)
    except orjson.JSONDecodeError:
        return True
    return not isinstance(payload, dict) or "sequence_number" in payload


def _name(given: Any) -> str | None:
    """An item id as a key: a string, or None for anything else an upstream sends."""
    return given if isinstance(given, str) else None


class ResponsesTransform:
    """Passes a Responses stream through (filling in the indices of one that has none); renders
    hal0d's endings as Responses events."""

    __slots__ = ("_decoder", "_held", "_in_line", "_item", "_next_output", "_numbered", "_part",
                 "_places", "_sequence", "done", "model", "response_id")

    def __init__(self, *, model: str | None) -> None:
        self.model = model
        self.response_id: str | None = None
        self.done = False
        self._decoder = Decoder(comments=True)
        self._sequence = 0
        self._next_output = 0
        self._item: tuple[str, int] | None = None  # the open message: (item id, output index)
        self._part: int | None = None  # the open output_text part's content index
        self._numbered: bool | None = None  # None until the first event is whole
        self._held: list[bytes] | None = None  # the first event's bytes until it is whole
        self._in_line = False  # the comments before the first event ended inside a line
        # An unnumbered stream's items by id: [output index, parts added].
        self._places: dict[str | None, list[int]] = {}

    def start(self) -> bytes:
        return b""

    def feed(self, chunk: bytes) -> bytes:
        if self._numbered is None:
            return self._first(chunk)
        events = self._decoder.feed(chunk)
        if not self._numbered:
            return self._filled(events)
        for event in events:
            if event is not COMMENT:
                self._note(event.event, event.data)
        return chunk

    def _first(self, chunk: bytes) -> bytes:
        """Until the first event is whole: the comment lines before it out as they came, its
        own bytes held; then the bytes held (a numbered stream) or the events filled in."""
        if not chunk:
            return b""
        out = b""
        if self._held is None:
            start = _field_start(chunk, in_line=self._in_line)
            if start < 0:
                self._decoder.feed(chunk)
                self._in_line = chunk[-1] not in b"\r\n"
                return chunk
            out, chunk, self._held = chunk[:start], chunk[start:], []
            self._decoder.feed(out)
        self._held.append(chunk)
        events = self._decoder.feed(chunk)
        first = next((event for event in events if event is not COMMENT), None)
        if first is None:
            return out
        held, self._held = b"".join(self._held), None
        self._numbered = _numbered(first.data)
        if not self._numbered:
            return out + self._filled(events)
        for event in events:
            if event is not COMMENT:
                self._note(event.event, event.data)
        return out + held

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
        if isinstance(kind, str):
            self._track(kind, payload)

    def _track(self, kind: str, payload: dict[str, Any]) -> None:
        """What the endings need to know of one upstream event."""
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

    def _filled(self, events: list[Event]) -> bytes:
        """An unnumbered stream's events, each written again with what it lacks."""
        out = []
        for event in events:
            if event is COMMENT:
                out.append(_PING)
                continue
            try:
                payload = orjson.loads(event.data)
            except orjson.JSONDecodeError:
                payload = None
            if not isinstance(payload, dict):
                out.append(frame(event.event, event.data.encode()))
                continue
            payload["sequence_number"] = self._sequence
            self._sequence += 1
            kind = payload.get("type", event.event)
            if isinstance(kind, str):
                self._fill(kind, payload)
                self._track(kind, payload)
            out.append(frame(event.event, orjson.dumps(payload)))
        return b"".join(out)

    def _fill(self, kind: str, payload: dict[str, Any]) -> None:
        """The fields an unnumbered event lacks (the module's docstring), from the items seen;
        a field it has is left as it is."""
        if kind in _LIFECYCLE:
            response = payload.get("response")
            if isinstance(response, dict):
                response.setdefault("created_at", int(time.time()))
                response.setdefault("model", self.model or "")
                response.setdefault("output", [])
            return
        if kind in ("response.output_item.added", "response.output_item.done"):
            item = payload.get("item")
            item_id = _name(item.get("id")) if isinstance(item, dict) else None
            place = self._places.get(item_id)
            if place is None or kind == "response.output_item.added":
                given = payload.get("output_index")
                place = [given if type(given) is int else self._next_output, 0]
                self._places[item_id] = place
                self._next_output = max(self._next_output, place[0] + 1)
            payload.setdefault("output_index", place[0])
            return
        if "item_id" not in payload:
            return
        # An item never added: the latest one's, the most a client can file it under.
        place = self._places.get(_name(payload["item_id"])) or [max(self._next_output - 1, 0), 0]
        payload.setdefault("output_index", place[0])
        if kind == "response.content_part.added":
            index = payload.setdefault("content_index", place[1])
            place[1] = max(place[1], index + 1) if type(index) is int else place[1] + 1
            part = payload.get("part")
            if isinstance(part, dict) and part.get("type") == "output_text":
                part.setdefault("annotations", [])
        elif kind in _IN_A_PART:
            payload.setdefault("content_index", max(place[1] - 1, 0))
            if kind in _WITH_LOGPROBS:
                payload.setdefault("logprobs", [])

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
