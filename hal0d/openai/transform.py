"""The OpenAI transform of the relay: upstream bytes out exactly as they came in (pure).

OpenAI-compatible upstreams already speak the client's protocol, so nothing is parsed on the way.
hal0d writes frames of its own only where a stream ends badly: a `chat.completion.chunk` (or
`text_completion`, for the legacy endpoint) with the stall guard's notice, and an error event when
the upstream broke off or never sent `data: [DONE]`. The OpenAI SDKs raise on the error event, so
a cut-off stream is never mistaken for a complete answer. While a streamed request waits (its
queue, its load, its first token), `keepalive(what)` is an SSE comment saying for what, which
clients skip; the upstream's own comment lines pass through as they came.

One field is rewritten: `model`, when the upstream names the model by a path (llama-server
started without --alias names it by its file's, `/srv/models/...gguf`; vLLM without
--served-model-name by its repository's) that is neither the name the client asked for nor the
one hal0d asked the upstream for: the answer then names the model the client asked for. A name
the upstream was given (`--alias smollm2`) is a name, and passes as it came. The stream's first
`model` field decides: when it needs nothing, as it almost always does, every later read passes
as it came, unlooked at; when it does, each read's `"model":"<the path>"` becomes the asked name
(one bytes.replace a read). Until then, and while renaming, only the bytes of a field that a
read's end cut are held, to the read that completes it.
"""

from __future__ import annotations

import re
import time
from typing import Any

import orjson

from hal0d.errors import ErrorCode
from hal0d.protocol.sse import comment
from hal0d.protocol.transform import (
    STALL_KEY,
    TAIL_BYTES,
    PureTail,
    StallTrip,
    TransformFailed,
)

__all__ = ["STALL_ID", "Passthrough", "error_event", "renamed", "stall_frame"]

STALL_ID = "hal0-stall-guard"
# An object's `model` field and its string value. Inside a JSON string every quote is escaped,
# so this matches a key, never text the model wrote.
_MODEL_FIELD = re.compile(rb'"model"\s*:\s*"((?:[^"\\]|\\.)*)"')
_MODEL_KEY = b'"model"'
# A `model` string field that a read's end cut (its key, colon or value unfinished).
_CUT_FIELD = re.compile(rb'"model"\s*(?::\s*(?:"(?:[^"\\]|\\.)*\\?)?)?\Z')
# How far into a stream the upstream's name is looked for (past llama-server's prefill pings),
# and how much of a `model` field cut by a read's end is held for the next (a long path).
_LOOK_BYTES = 16 * 1024
_FIELD_LIMIT = 4 * 1024


def _named_model(data: bytes) -> tuple[bytes, str] | None:
    """The first `model` field in `data` (as it is written) and its value."""
    if (found := _MODEL_FIELD.search(data)) is None:
        return None
    try:
        value = orjson.loads(b'"' + found.group(1) + b'"')
    except orjson.JSONDecodeError:
        return None
    return found.group(0), value


def _needs_renaming(named: str, model: str | None, served: str | None) -> bool:
    """Whether the upstream's name for the model is a path the client did not ask for."""
    return named not in (model, served) and ("/" in named or "\\" in named)


def renamed(data: bytes, model: str, served: str) -> bytes:
    """A whole answer (one JSON object) with `model` as its model, when it names the model by a
    path that is neither that nor `served` (the name the upstream was asked for)."""
    named = _named_model(data)
    if named is None or not _needs_renaming(named[1], model, served):
        return data
    try:
        answer = orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
    if not isinstance(answer, dict) or not isinstance(answer.get("model"), str):
        return data
    answer["model"] = model
    return orjson.dumps(answer)


def _cut_prefix(data: bytes, field: bytes) -> int:
    """How many of `data`'s last bytes begin `field` (a read that ends inside it). A read that
    ends a line (as most do, at an event's end) cannot: a data line holds no line break."""
    if data.endswith((b"\n", b"\r")):
        return 0
    at = data.find(b'"', max(0, len(data) - len(field) + 1))
    while at != -1:
        if field.startswith(data[at:]):
            return len(data) - at
        at = data.find(b'"', at + 1)
    return 0


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
    """Bytes out exactly as they came in, the model renamed (the module's docstring); frames
    only for hal0d's own endings.

    The only thing it looks at is the end of a successful SSE stream: one without `data: [DONE]`
    was cut short by the upstream, and the client is told so instead of being left to guess.
    """

    __slots__ = ("_carry", "_field", "_looking", "_to", "expect_done", "legacy_completion",
                 "model", "served", "sse")

    def __init__(
        self, *, sse: bool, legacy_completion: bool, model: str | None, expect_done: bool,
        served: str | None = None,
    ) -> None:
        self.sse = sse
        self.legacy_completion = legacy_completion
        self.model = model  # as the client asked for it
        self.served = served  # as the upstream was asked for it
        self.expect_done = expect_done
        # Bytes left to find the upstream's name in (0: decided), and when it is not the asked
        # one, its field as written and the field to write instead; a cut field's start.
        self._looking = _LOOK_BYTES if sse and model else 0
        self._field: bytes | None = None
        self._to = b""
        self._carry = b""
        super().__init__()

    def feed(self, chunk: bytes) -> bytes:
        if self._looking:
            chunk = self._look(chunk)
        elif self._field is not None:
            chunk = self._rename(chunk)
        # PureTail.feed written out: this runs for every chunk, and a call costs more than it.
        self._tail = (self._tail + chunk[-TAIL_BYTES:])[-TAIL_BYTES:]
        return chunk

    def _look(self, chunk: bytes) -> bytes:
        """The reads before the first `model` field: passed on, but for a field cut by a read's
        end (held for the next)."""
        if self._carry:
            chunk, self._carry = self._carry + chunk, b""
        if (named := _named_model(chunk)) is not None:
            self._looking = 0
            field, upstream_name = named
            if not _needs_renaming(upstream_name, self.model, self.served):
                return chunk
            self._field, self._to = field, b'"model":' + orjson.dumps(self.model)
            return self._rename(chunk)
        self._looking = max(0, self._looking - len(chunk))
        at = chunk.rfind(_MODEL_KEY)
        if at != -1:
            cut = len(chunk) - at if _CUT_FIELD.match(chunk, at) else 0
        else:
            cut = _cut_prefix(chunk, _MODEL_KEY)
        if cut > _FIELD_LIMIT or not self._looking:  # a field no model's name is that long
            self._looking = 0
        elif cut:
            chunk, self._carry = chunk[:-cut], chunk[-cut:]
        return chunk

    def _rename(self, chunk: bytes) -> bytes:
        assert self._field is not None
        if self._carry:
            chunk, self._carry = self._carry + chunk, b""
        chunk = chunk.replace(self._field, self._to)
        if cut := _cut_prefix(chunk, self._field):
            chunk, self._carry = chunk[:-cut], chunk[-cut:]
        return chunk

    def _held(self) -> bytes:
        """What a cut field kept back, for the stream's last write."""
        held, self._carry = self._carry, b""
        return held

    def complete(self) -> bool:
        tail = self._tail.rstrip()
        return self.expect_done and tail.endswith((b"data: [DONE]", b"data:[DONE]"))

    def end(self) -> bytes:
        if not self.expect_done or self.complete():
            return self._held()
        message = "the upstream ended the stream without data: [DONE]; the answer may be cut"
        raise TransformFailed(
            ErrorCode.UPSTREAM_INCOMPLETE,
            self._held() + error_event(message, "dispatch.upstream_incomplete"),
        )

    def stalled(self, trip: StallTrip) -> bytes:
        if not self.sse:
            return b""  # audio, images: cut off, nothing injected
        return self._held() + stall_frame(trip, legacy_completion=self.legacy_completion,
                                          model=self.model)

    def broken(self, message: str) -> bytes:
        return self._held() + error_event(message, "dispatch.upstream_broken") if self.sse else b""

    def keepalive(self, what: str) -> bytes:
        """`: hal0d: <what>`, one comment line; b"" for a body that is not SSE."""
        return comment(f"hal0d: {what}") if self.sse else b""
