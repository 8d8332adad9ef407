"""The Ollama stream translator: OpenAI chat.completion.chunk dicts in, Ollama's NDJSON objects
out, for /api/chat (`message`) and /api/generate (`response`).

Sans-I/O like the Anthropic translator: the relay owns the sockets and the SSE parsing, this the
protocol; the clocks are handed in, so a test can fix them. Pure (tests/test_purity.py).

    STREAMING ──finish_reason──► FINISHING ──chunk with usage──► DONE
        │                            └──────────finish()─────────► DONE
        └──finish() without a finish_reason: Incomplete

Each chunk's content is one object `{"model", "created_at", "message": {"role": "assistant",
"content"}, "done": false}`; reasoning is `message.thinking` unless the request said `think:
false` (when a request does not say, Ollama thinks with a model that can: server/routes.go),
and left out then, unless the model said nothing else: an answer of reasoning alone is sent as
its content at the finish, so no client shows an empty message where the model spoke. Tool calls
are gathered until the finish_reason and sent as one object whose `arguments` are objects, as
Ollama's own parser sends them. The last object is
`"done": true` with `done_reason` (stop, length), the counts from the upstream's usage (the
generated chunks when it sent none) and the durations in nanoseconds from hal0d's clocks:

    total_duration         the request's arrival to the last object
    load_duration          the wait for the slot's model to load
    prompt_eval_duration   the upstream request sent to its first generated token
    eval_duration          the first generated token to the last

A keepalive (the upstream's comment line while it reads the prompt, or hal0d's own while the
request waits) is an object of the same shape with empty content and `"done": false`: the
official client (ollama-python) parses it into a ChatResponse / GenerateResponse like any other
piece, and a client that prints or joins the content adds nothing.

A stream that cannot end well ends with one `{"error": ...}` object (Ollama's own way), so a
client raises rather than take a cut answer for a whole one; before it, a piece of content says
so in words (`notice`), since some clients (Open WebUI) drop that last line and would show the
cut answer as a whole one; a stall-guard trip instead ends it
with a last `done` object carrying the notice, done_reason length and `x_hal0_stall`.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from hal0d.protocol.chat_chunk import ChatChunk, MalformedChunk, ToolCallFragment, read_chunk
from hal0d.protocol.transform import STALL_KEY, StallTrip

__all__ = [
    "DONE_REASONS",
    "NS",
    "Clocks",
    "Incomplete",
    "MalformedChunk",
    "State",
    "Translator",
    "encode",
    "error_object",
    "failure_notice",
    "timestamp",
]

NS = 1_000_000_000
# OpenAI's finish reasons as Ollama says them: a tool call is a stop, a cut answer a length.
DONE_REASONS = {"length": "length"}


class Incomplete(MalformedChunk):
    """The upstream ended the stream without saying why it stopped."""


class State(enum.Enum):
    STREAMING = "streaming"
    FINISHING = "finishing"
    DONE = "done"


def timestamp(wall: float) -> str:
    """Go's RFC 3339 time, as Ollama's created_at (UTC)."""
    return datetime.fromtimestamp(wall, UTC).isoformat(timespec="microseconds").replace(
        "+00:00", "Z")


@dataclass(slots=True)
class Clocks:
    """The monotonic instants the durations are made of (seconds), and the wall clock."""

    started: float  # the request arrived
    opened: float  # the upstream request was sent
    load_s: float = 0.0
    now: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    first: float | None = None  # the first generated token
    last: float | None = None  # the last one

    def metrics(self) -> dict[str, int]:
        end = self.now()
        first = self.first if self.first is not None else end
        last = self.last if self.last is not None else end
        return {
            "total_duration": round((end - self.started) * NS),
            "load_duration": round(self.load_s * NS),
            "prompt_eval_duration": round(max(0.0, first - self.opened) * NS),
            "eval_duration": round(max(0.0, last - first) * NS),
        }


@dataclass(slots=True)
class _Call:
    id: str
    name: str
    arguments: list[str] = field(default_factory=list)


class Translator:
    __slots__ = (
        "_calls",
        "_chat",
        "_clocks",
        "_completion_tokens",
        "_done_reason",
        "_fragments",
        "_held",
        "_model",
        "_prompt_tokens",
        "_said",
        "_state",
        "_think",
    )

    def __init__(self, model: str, clocks: Clocks, *, chat: bool, think: bool | None) -> None:
        self._model = model
        self._clocks = clocks
        self._chat = chat
        # None (not said) streams the reasoning as `thinking`, as Ollama does; False holds it.
        self._think = think is not False
        self._state = State.STREAMING
        self._calls: dict[object, _Call] = {}
        self._done_reason: str | None = None
        self._fragments = 0
        self._prompt_tokens: int | None = None
        self._completion_tokens: int | None = None
        # What the client has had of the answer (content, thinking or a tool call), and the
        # reasoning left out of it (think: false), which is the content of an answer that
        # would otherwise be empty.
        self._said = False
        self._held: list[str] = []

    @property
    def done(self) -> bool:
        return self._state is State.DONE

    @property
    def finished(self) -> bool:
        """The upstream said why it stopped (the answer is whole, usage may follow)."""
        return self._state is not State.STREAMING

    def feed(self, chunk: object) -> list[dict[str, Any]]:
        """One parsed upstream chunk's objects; MalformedChunk when it is no chunk at all."""
        if self._state is State.DONE:
            return []  # usage after the last object, or a vLLM-style trailing chunk
        read = read_chunk(chunk)
        out: list[dict[str, Any]] = []
        self._translate(read, out)
        if read.has_usage:
            self._usage(read)
            if self._state is State.FINISHING:
                out.append(self._last())
        return out

    def keepalive(self) -> dict[str, Any]:
        """An object that says nothing (empty content, not done), for a client's idle timeout."""
        return self._object("", None)

    def _translate(self, read: ChatChunk, out: list[dict[str, Any]]) -> None:
        """The chunk's text, reasoning, tool calls and finish as Ollama objects."""
        content, reasoning = read.content, read.reasoning
        if read.tool_calls:
            self._gather(read.tool_calls)
        if content or reasoning:
            self._generated()
            if reasoning and not self._think:
                self._held.append(reasoning)
            if content or (reasoning and self._think):
                self._said = True
                out.append(self._object(content or "", reasoning if self._think else None))
        finish = read.finish_reason
        if finish is not None and self._state is State.STREAMING:
            self._done_reason = DONE_REASONS.get(finish, "stop")
            self._state = State.FINISHING
            if self._calls:
                self._said = True
                out.append(self._tool_object())
            elif self._held and not self._said:
                out.append(self._object("".join(self._held), None))  # reasoning alone

    def _generated(self) -> None:
        self._fragments += 1
        now = self._clocks.now()
        if self._clocks.first is None:
            self._clocks.first = now
        self._clocks.last = now

    def _gather(self, fragments: tuple[ToolCallFragment, ...]) -> None:
        """Each fragment's arguments onto its call (by index, else id): Ollama sends the calls
        whole, at the finish."""
        self._generated()
        for fragment in fragments:
            key = fragment.index if fragment.index is not None else fragment.id
            known = self._calls.get(key)
            if known is None:
                if not fragment.name:
                    raise MalformedChunk("upstream chunk: a new tool call has no function name")
                known = self._calls[key] = _Call(fragment.id or f"call_{len(self._calls)}",
                                                 fragment.name)
            if fragment.arguments:
                known.arguments.append(fragment.arguments)

    def _usage(self, read: ChatChunk) -> None:
        if read.prompt_tokens is not None:
            self._prompt_tokens = read.prompt_tokens
        if read.completion_tokens is not None:
            self._completion_tokens = read.completion_tokens

    def _tool_object(self) -> dict[str, Any]:
        calls = []
        for index, call in enumerate(self._calls.values()):
            text = "".join(call.arguments).strip() or "{}"
            try:
                arguments = orjson.loads(text)
            except orjson.JSONDecodeError:
                raise MalformedChunk(f"upstream tool call {call.name!r} has arguments that are "
                                     "not JSON") from None
            if not isinstance(arguments, dict):
                raise MalformedChunk(f"upstream tool call {call.name!r} has arguments that are "
                                     "not a JSON object")
            calls.append({"id": call.id,
                          "function": {"index": index, "name": call.name,
                                       "arguments": arguments}})
        self._calls = {}
        obj = self._object("", None)
        (obj["message"] if self._chat else obj)["tool_calls"] = calls
        return obj

    def _object(self, text: str, thinking: str | None, *, done: bool = False) -> dict[str, Any]:
        obj: dict[str, Any] = {"model": self._model,
                               "created_at": timestamp(self._clocks.wall())}
        if self._chat:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            obj["message"] = message
        else:
            obj["response"] = text
            if thinking:
                obj["thinking"] = thinking
        obj["done"] = done
        return obj

    def _last(self, text: str = "", done_reason: str | None = None) -> dict[str, Any]:
        self._state = State.DONE
        obj = self._object(text, None, done=True)
        obj["done_reason"] = done_reason or self._done_reason or "stop"
        metrics = self._clocks.metrics()
        obj["total_duration"] = metrics["total_duration"]
        obj["load_duration"] = metrics["load_duration"]
        if self._prompt_tokens is not None:
            obj["prompt_eval_count"] = self._prompt_tokens
        obj["prompt_eval_duration"] = metrics["prompt_eval_duration"]
        obj["eval_count"] = self.eval_count
        obj["eval_duration"] = metrics["eval_duration"]
        return obj

    @property
    def eval_count(self) -> int:
        return self._fragments if self._completion_tokens is None else self._completion_tokens

    @property
    def prompt_tokens(self) -> int | None:
        return self._prompt_tokens

    def finish(self) -> list[dict[str, Any]]:
        """The upstream ended the stream ([DONE] or its end)."""
        if self._state is State.DONE:
            return []
        if self._state is State.STREAMING:
            raise Incomplete("upstream ended the stream without a finish_reason")
        return [self._last()]

    def notice(self, message: str) -> dict[str, Any]:
        """A piece of content that says the answer failed, `message` saying why: what a person
        reads where the answer stopped, before the error line a client raises on."""
        return self._object(failure_notice(message, cut=self._said), None)

    def stalled(self, trip: StallTrip) -> list[dict[str, Any]]:
        """The stall guard's last object: the notice as the answer's end, done, length."""
        if self._state is State.DONE:
            return []
        obj = self._last("\n\n" + trip.notice(), "length")
        obj[STALL_KEY] = trip.details()
        return [obj]


def failure_notice(message: str, *, cut: bool) -> str:
    """The words of a failure put into the answer: after a part of it (`cut`), or in place
    of it."""
    if cut:
        return f"\n\n[hal0] the answer was cut off: {message}"
    return f"[hal0] no answer: {message}"


def error_object(message: str) -> dict[str, Any]:
    """The one object that ends a stream that cannot end well: a client raises on it."""
    return {"error": message}


def encode(objects: list[dict[str, Any]]) -> bytes:
    """NDJSON: one compact JSON object a line."""
    return b"".join([orjson.dumps(obj) + b"\n" for obj in objects])
