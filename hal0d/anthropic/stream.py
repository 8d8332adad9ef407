"""The Anthropic stream translator: OpenAI chat.completion.chunk dicts in, Anthropic events out.

Sans-I/O in the manner of h11: the relay owns the sockets, the clocks and the JSON parsing of
upstream frames; this module owns the protocol, so every rule is testable as "these chunks in,
these events out". It imports neither asyncio nor aiohttp (tests/test_purity.py holds it to that).

States (`Translator.state`):

    IDLE ──feed, begin()──► STREAMING ──finish_reason──► STOPPING ──chunk with usage──► DONE ──finish()──► CLOSED
     │                         │                             └───────────finish()────────────────────────► CLOSED
     │                         └──finish() with no finish_reason seen──► FAILED
     └──fail()──► FAILED ◄──fail()── STREAMING, STOPPING

Anthropic clients are strict, so the translator guarantees: message_start first (a ping waits
for it too); block indices contiguous from 0 in emission order; one block open at a time and a
content_block_stop for every start; message_delta then message_stop exactly once, last. A
failure is one `error` event and nothing after it, never a message_stop: a truncated answer must
not look complete (the SDK raises on an error event).

message_start may go out before the first chunk (`begin()`: with the response's head, or before
the first `ping()`, which never comes before it), since it carries nothing an upstream chunk must
tell: the model, the id and the prompt's count as hal0d counted it. When the upstream's own
usage.prompt_tokens then differs, message_delta carries the upstream's (its usage has
input_tokens, and the anthropic SDK takes a message_delta's input_tokens over message_start's).
A ping is `{"type": "ping"}`, as Anthropic's API sends between any two events of an open
message; clients skip it.

Why STOPPING waits: the finish_reason chunk and the usage chunk are separate in llama-server and
OpenAI (a trailing `"choices": []` chunk), so message_delta is held until a chunk with usage or
the end of the stream, never longer. vLLM with continuous usage stats puts usage on the finish
chunk itself, and keeps sending usage chunks after it; those are ignored once DONE.

Token counts: usage.prompt_tokens and usage.completion_tokens from the upstream win, the latest
seen. llama-cpp-python ignores include_usage when streaming, so without an upstream count
output_tokens is the number of chunks that carried generated text, reasoning or tool arguments.
Servers emit about one token per chunk, so this is close, but it is an approximation.

The prompt's cached part (usage.prompt_tokens_details.cached_tokens, or llama-server's timings on
its last chunk) is known only at the end, so message_start counts the whole prompt as
input_tokens and message_delta says it in Anthropic's sense: cache_read_input_tokens the cached
part, input_tokens the rest (the SDK takes both over message_start's). An upstream that says
nothing of a cache gets no cache_read_input_tokens.
"""

from __future__ import annotations

import enum
import secrets
from collections.abc import Sequence
from typing import Any

import orjson

from hal0d.anthropic.stop import anthropic_stop
from hal0d.protocol.chat_chunk import ChatChunk, MalformedChunk, read_chunk
from hal0d.protocol.sse import encode

__all__ = [
    "Event",
    "MalformedChunk",
    "State",
    "Translator",
    "TranslatorError",
    "encode_events",
    "new_message_id",
    "new_tool_use_id",
]

Event = tuple[str, dict[str, Any]]

_THINKING = "thinking"
_TEXT = "text"
_TOOL_USE = "tool_use"


class State(enum.Enum):
    IDLE = "idle"
    STREAMING = "streaming"
    STOPPING = "stopping"
    DONE = "done"
    CLOSED = "closed"
    FAILED = "failed"


class TranslatorError(RuntimeError):
    """The caller drove the translator in an order no stream can produce.

    An upstream's broken chunk or impossible order is MalformedChunk instead (the protocol's,
    re-exported here): the translator's state is untouched by the offending chunk, and the
    caller should `fail()` the stream with its message.
    """


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


# (opens a block, tool key, id, name, argument fragment)
_ToolPiece = tuple[bool, object, str, str, str]


class Translator:
    __slots__ = (
        "_blocks",
        "_cached",
        "_fragments",
        "_input_tokens",
        "_message_id",
        "_model",
        "_open",
        "_open_tool",
        "_state",
        "_stop_reason",
        "_stop_sequence",
        "_stop_sequences",
        "_tool_keys",
        "_upstream_output",
    )

    def __init__(
        self,
        model: str,
        *,
        input_tokens: int | None = None,
        message_id: str | None = None,
        stop_sequences: Sequence[str] = (),
    ) -> None:
        self._model = model
        self._message_id = message_id or new_message_id()
        self._stop_sequences = tuple(stop_sequences)
        self._state = State.IDLE
        self._input_tokens = input_tokens
        self._upstream_output: int | None = None
        self._cached: int | None = None  # of the prompt, what the upstream's cache held
        self._fragments = 0
        self._blocks = 0
        self._open: str | None = None
        # Tool calls are keyed by their OpenAI index (or id, for servers that omit the index).
        self._open_tool: object = None
        self._tool_keys: set[object] = set()
        self._stop_reason: str | None = None
        self._stop_sequence: str | None = None

    @property
    def state(self) -> State:
        return self._state

    @property
    def done(self) -> bool:
        """message_stop or an error was emitted: nothing more will reach the client."""
        return self._state in (State.DONE, State.CLOSED, State.FAILED)

    @property
    def input_tokens(self) -> int:
        return self._input_tokens or 0

    @property
    def output_tokens(self) -> int:
        return self._fragments if self._upstream_output is None else self._upstream_output

    @property
    def stop_reason(self) -> str | None:
        return self._stop_reason

    def begin(self, input_tokens: int | None = None) -> list[Event]:
        """message_start now, before the first chunk: with `input_tokens` when given (it is then
        the prompt's count unless the upstream's usage says otherwise), else the count the
        translator was built with. Once it is out, no chunk brings another."""
        if self._state is not State.IDLE:
            raise TranslatorError(f"begin() after the stream was {self._state.value}")
        if input_tokens is not None:
            self._input_tokens = input_tokens
        self._state = State.STREAMING
        return [self._message_start()]

    def ping(self) -> list[Event]:
        """A keepalive: the ping event, after message_start (sent first when it is not out)."""
        state = self._state
        if state is State.IDLE:
            return [*self.begin(), _ping()]
        if state is State.STREAMING or state is State.STOPPING:
            return [_ping()]
        raise TranslatorError(f"ping() after the stream was {state.value}")

    def feed(self, chunk: dict[str, Any]) -> list[Event]:
        """Translate one parsed upstream chunk; raises MalformedChunk before changing any state.

        Once message_stop is out, chunks are ignored unread: nothing more can reach the client,
        and vLLM keeps sending usage after the finish.
        """
        state = self._state
        if state is State.DONE:
            return []
        if state is State.CLOSED or state is State.FAILED:
            raise TranslatorError(f"feed() after the stream was {state.value}")
        read = read_chunk(chunk)
        tools = self._tool_pieces(read) if read.tool_calls else ()
        generated = bool(read.content or read.reasoning or tools)
        if generated and state is State.STOPPING:
            raise MalformedChunk("upstream sent output after its finish_reason")

        # Validated whole: from here on the chunk changes state and becomes events.
        if read.prompt_tokens is not None:
            self._input_tokens = read.prompt_tokens
        if read.completion_tokens is not None:
            self._upstream_output = read.completion_tokens
        if read.cached_tokens is not None:
            self._cached = read.cached_tokens
        events: list[Event] = []
        if state is State.IDLE:
            events.append(self._message_start())
            self._state = state = State.STREAMING
        if generated:
            self._fragments += 1
            self._emit_output(events, read, tools)
        if read.finish_reason is not None and state is State.STREAMING:
            assert read.choice is not None
            self._stop_reason, self._stop_sequence = anthropic_stop(
                read.choice, self._stop_sequences, used_tools=bool(self._tool_keys)
            )
            self._close_block(events)
            self._state = state = State.STOPPING
        if read.has_usage and state is State.STOPPING:
            self._end_message(events)
        return events

    def _emit_output(
        self, events: list[Event], read: ChatChunk, tools: Sequence[_ToolPiece]
    ) -> None:
        """The chunk's generated output as block deltas, in the order thinking, text, tool calls;
        each kind opens its block first unless that block is the open one."""
        index = self._blocks - 1
        if read.reasoning:
            if self._open is not _THINKING:
                index = self._start(
                    events, _THINKING, {"type": "thinking", "thinking": "", "signature": ""}
                )
            events.append(_delta(index, {"type": "thinking_delta", "thinking": read.reasoning}))
        if read.content:
            if self._open is not _TEXT:
                index = self._start(events, _TEXT, {"type": "text", "text": ""})
            events.append(_delta(index, {"type": "text_delta", "text": read.content}))
        for opens, key, call_id, name, arguments in tools:
            if opens:
                index = self._start(
                    events,
                    _TOOL_USE,
                    {"type": "tool_use", "id": call_id, "name": name, "input": {}},
                )
                self._open_tool = key
                self._tool_keys.add(key)
            if arguments:
                delta = {"type": "input_json_delta", "partial_json": arguments}
                events.append(_delta(index, delta))

    def finish(self) -> list[Event]:
        """The upstream ended the stream ([DONE] or a clean EOF)."""
        state = self._state
        if state is State.DONE:
            self._state = State.CLOSED
            return []
        if state is State.STOPPING:
            events: list[Event] = []
            self._end_message(events)
            self._state = State.CLOSED
            return events
        if state is State.IDLE or state is State.STREAMING:
            events = [self._message_start()] if state is State.IDLE else []
            events.append(
                _error_event("upstream ended the stream without a finish_reason", "api_error")
            )
            self._state = State.FAILED
            return events
        raise TranslatorError(f"finish() after the stream was {state.value}")

    def fail(self, message: str, *, error_type: str = "api_error") -> list[Event]:
        """The stream broke (upstream error, stall guard, shutdown): one error event, nothing else.

        Before message_start the error stands alone. Open blocks stay unclosed on purpose: a
        content_block_stop or message_stop would make a truncated answer look complete.
        """
        state = self._state
        if state is State.DONE or state is State.CLOSED or state is State.FAILED:
            raise TranslatorError(f"fail() after the stream was {state.value}")
        self._state = State.FAILED
        return [_error_event(message, error_type)]

    def _tool_pieces(self, read: ChatChunk) -> list[_ToolPiece]:
        """Each fragment keyed to its call (the OpenAI index, else the id, else the open call),
        and whether it opens a block: an Anthropic block once closed never reopens."""
        # Text or reasoning earlier in the same chunk closes the open tool block first.
        reopens = bool(read.content or read.reasoning)
        current = None if reopens or self._open is not _TOOL_USE else self._open_tool
        pieces: list[_ToolPiece] = []
        opened: set[object] = set()
        for fragment in read.tool_calls:
            index, call_id, name = fragment.index, fragment.id, fragment.name
            key: object = index if index is not None else (call_id or current)
            if key is None:
                raise MalformedChunk("upstream chunk: tool call fragment without index or id")
            opens = key != current
            if opens:
                if key in self._tool_keys or key in opened:
                    raise MalformedChunk(
                        "upstream interleaved tool calls: an earlier tool call resumed"
                    )
                if not name:
                    raise MalformedChunk("upstream chunk: a new tool call has no function name")
                opened.add(key)
                current = key
            pieces.append((opens, key, call_id or new_tool_use_id(), name or "", fragment.arguments))
        return pieces

    def _message_start(self) -> Event:
        return (
            "message_start",
            {
                "type": "message_start",
                "message": {
                    "id": self._message_id,
                    "type": "message",
                    "role": "assistant",
                    "model": self._model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": self.input_tokens, "output_tokens": 0},
                },
            },
        )

    def _start(self, events: list[Event], kind: str, block: dict[str, Any]) -> int:
        self._close_block(events)
        index = self._blocks
        self._blocks = index + 1
        self._open = kind
        events.append(
            (
                "content_block_start",
                {"type": "content_block_start", "index": index, "content_block": block},
            )
        )
        return index

    def _close_block(self, events: list[Event]) -> None:
        if self._open is not None:
            events.append(
                ("content_block_stop", {"type": "content_block_stop", "index": self._blocks - 1})
            )
            self._open = None
            self._open_tool = None

    def _end_message(self, events: list[Event]) -> None:
        self._close_block(events)
        usage = {"input_tokens": self.input_tokens, "output_tokens": self.output_tokens}
        if self._cached is not None:
            cached = min(self._cached, self.input_tokens)
            usage["input_tokens"] -= cached
            usage["cache_read_input_tokens"] = cached
        events.append(
            (
                "message_delta",
                {
                    "type": "message_delta",
                    "delta": {
                        "stop_reason": self._stop_reason,
                        "stop_sequence": self._stop_sequence,
                    },
                    "usage": usage,
                },
            )
        )
        events.append(("message_stop", {"type": "message_stop"}))
        self._state = State.DONE


def encode_events(events: list[Event]) -> bytes:
    """SSE frames with compact JSON, each with its event: line; empty bytes for no events."""
    return b"".join([encode(name, orjson.dumps(payload)) for name, payload in events])


def _delta(index: int, delta: dict[str, Any]) -> Event:
    return ("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})


def _ping() -> Event:
    return ("ping", {"type": "ping"})


def _error_event(message: str, error_type: str) -> Event:
    return ("error", {"type": "error", "error": {"type": error_type, "message": message}})
