"""The Responses bridge: a chat completion stream in, the Responses API's events out (pure), for a
slot whose upstream has no /v1/responses (`responses = "translate"`; the request's side is
responses_request.py, a whole answer's responses_answer.py).

Sans-I/O like the Anthropic translator (hal0d/anthropic/stream.py): `Bridge` takes parsed
chat.completion.chunk dicts and returns events, `BridgeTransform` is the relay's Transform
around it (SSE bytes in, SSE frames out, `data: [DONE]` consumed), the skeleton every
translating surface shares (hal0d/protocol/translating.py) with the bridge's endings.

    IDLE ──first chunk──► STREAMING ──finish_reason──► STOPPING ──usage chunk or end──► DONE
     │                        │                            (response.completed, or
     │                        │                             response.incomplete for "length")
     └───────── end without a finish_reason, a malformed chunk, a break ──► FAILED
                (`error`, then response.failed)       a stall trip ──► DONE (response.incomplete)

What a Responses client (the openai SDK's accumulator, the Codex CLI) holds it to, and the
bridge guarantees: `response.created` then `response.in_progress` first, one id throughout;
output items one at a time, each `response.output_item.added` before its content events and
closed by `response.output_item.done` before the next opens, `output_index` counting from 0;
`content_index` on every part event; `sequence_number` from 0 on every event; the terminal
event carries the whole output and the usage (with input_tokens_details.cached_tokens, the part
of the prompt the upstream took from its cache, when its usage or llama-server's timings say it).

    chat delta                 Responses output item and its events
    reasoning_content          reasoning (response.reasoning_text.delta / .done)
    content                    message with one output_text part (response.output_text.delta)
    tool_calls of a function   function_call (response.function_call_arguments.delta / .done)
      of a custom tool         custom_tool_call, its `input` out of the call's {"input": ...}
      of local_shell           local_shell_call, its exec action out of the call's arguments
                               (these two are whole when their call ends: added, then done)

A keepalive (the upstream's comment line while it reads the prompt, or hal0d's own while the
request waits) is an SSE comment line, which every Responses client skips: `: ping`, or
`: hal0d: <what>` when the wait has words (`keepalive(what)`), as the native path's.

A stall trip ends the stream as the native path does (hal0d/openai/responses.py): the guard's
notice as the open message's last text delta, then `response.incomplete` with
`incomplete_details.reason = "max_output_tokens"` and the cause under `x_hal0_stall`.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import Any

import orjson

from hal0d.errors import ErrorCode
from hal0d.openai.responses import failure_events
from hal0d.openai.responses_answer import (
    INCOMPLETE_REASONS,
    call_item,
    message_item,
    new_item_id,
    new_response_id,
    reasoning_item,
    response_object,
    usage_of,
)
from hal0d.openai.responses_request import FUNCTION, ChatRequest
from hal0d.protocol.chat_chunk import ChatChunk, MalformedChunk, ToolCallFragment, read_chunk
from hal0d.protocol.sse import comment, encode
from hal0d.protocol.transform import STALL_KEY, StallTrip
from hal0d.protocol.translating import Translating, Unfinished

__all__ = ["Bridge", "BridgeTransform", "Event", "MalformedChunk", "State", "encode_events"]

Event = tuple[str, dict[str, Any]]
_REASONING, _MESSAGE, _CALL = "reasoning", "message", "call"


class State(enum.Enum):
    IDLE = "idle"
    STREAMING = "streaming"
    STOPPING = "stopping"
    DONE = "done"
    FAILED = "failed"


@dataclass(slots=True)
class _Open:
    """The output item being streamed."""

    kind: str  # _REASONING, _MESSAGE or _CALL
    item_id: str
    index: int
    text: str = ""  # the text, the reasoning, or a call's arguments so far
    key: object = None  # a call's chat index (or id)
    call_id: str = ""
    name: str = ""  # a call's chat function name
    announced: bool = False  # a function call's output_item.added is out


class Bridge:
    """One chat stream's Responses events."""

    def __init__(self, request: ChatRequest, model: str, *, response_id: str | None = None,
                 created_at: int | None = None) -> None:
        self.request = request
        self.model = model
        self.response_id = response_id or new_response_id()
        self.created_at = created_at if created_at is not None else int(time.time())
        self.state = State.IDLE
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._open: _Open | None = None
        self._finish: str | None = None
        self._fragments = 0
        self._reasoning_fragments = 0
        self._usage: ChatChunk | None = None  # the latest chunk that carried usage
        self._cached: int | None = None  # the prompt's cached part (usage or timings)

    @property
    def done(self) -> bool:
        return self.state in (State.DONE, State.FAILED)

    @property
    def finish_reason(self) -> str | None:
        return self._finish

    def feed(self, chunk: Any) -> list[Event]:
        """One parsed upstream chunk; MalformedChunk before any state changes."""
        if self.done:
            return []
        read = read_chunk(chunk)
        generated = bool(read.content or read.reasoning or read.tool_calls)
        if generated and self.state is State.STOPPING:
            raise MalformedChunk("upstream sent output after its finish_reason")
        events = self._opening()
        if read.has_usage:
            self._usage = read
        if read.cached_tokens is not None:
            self._cached = read.cached_tokens
        if read.reasoning:
            self._reasoning_fragments += 1
            self._reason(events, read.reasoning)
        if read.content:
            self._write(events, read.content)
        for fragment in read.tool_calls:
            self._call(events, fragment)
        if generated:
            self._fragments += 1
        if read.finish_reason is not None and self.state is State.STREAMING:
            self._finish = read.finish_reason
            self._close(events)
            self.state = State.STOPPING
        if read.has_usage and self.state is State.STOPPING:
            events += self._terminal()
        return events

    def finish(self) -> list[Event]:
        """The upstream ended the stream ([DONE] or a clean end of the body)."""
        if self.done:
            return []
        if self.state is State.STOPPING:
            return self._terminal()
        return self.failed("the upstream ended the stream without a finish_reason",
                         ErrorCode.UPSTREAM_INCOMPLETE)

    def failed(self, message: str, code: str = ErrorCode.UPSTREAM_BROKEN) -> list[Event]:
        """An `error` event (with the `error` object the openai SDK raises on), then
        `response.failed`: a cut answer never reads as a whole one."""
        if self.done:
            return []
        events = self._opening()
        events += failure_events(self._event, self._response("failed"), message, code)
        self.state = State.FAILED
        return events

    def stalled(self, trip: StallTrip) -> list[Event]:
        """The guard's notice in the open (or a new) message, then `response.incomplete`."""
        if self.done:
            return []
        events = self._opening()
        if self._open is not None and self._open.kind != _MESSAGE:
            self._close(events, status="incomplete")
        self._write(events, "\n\n" + trip.notice() if self._fragments else trip.notice())
        response = self._response("incomplete", with_open=True)
        response["incomplete_details"] = {"reason": "max_output_tokens"}
        response[STALL_KEY] = trip.details()
        events.append(self._event("response.incomplete", response=response))
        self.state = State.DONE
        return events

    # The events of each kind of output.

    def _opening(self) -> list[Event]:
        if self.state is not State.IDLE:
            return []
        self.state = State.STREAMING
        return [self._event("response.created", response=self._response("in_progress")),
                self._event("response.in_progress", response=self._response("in_progress"))]

    def _reason(self, events: list[Event], text: str) -> None:
        current = self._ensure(events, _REASONING)
        current.text += text
        events.append(self._event("response.reasoning_text.delta", item_id=current.item_id,
                                  output_index=current.index, content_index=0, delta=text))

    def _write(self, events: list[Event], text: str) -> None:
        current = self._ensure(events, _MESSAGE)
        current.text += text
        events.append(self._event("response.output_text.delta", item_id=current.item_id,
                                  output_index=current.index, content_index=0, delta=text,
                                  logprobs=[]))

    def _ensure(self, events: list[Event], kind: str) -> _Open:
        """The open item when it is of `kind`; else the open one closed and a new one added."""
        if self._open is not None and self._open.kind == kind:
            return self._open
        self._close(events)
        prefix = "rs" if kind == _REASONING else "msg"
        current = self._open = _Open(kind, new_item_id(prefix), len(self._output))
        if kind == _REASONING:
            item: dict[str, Any] = {"id": current.item_id, "type": "reasoning", "summary": [],
                                    "content": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": current.item_id, "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events.append(self._event("response.output_item.added", output_index=current.index,
                                  item=item))
        events.append(self._event("response.content_part.added", item_id=current.item_id,
                                  output_index=current.index, content_index=0, part=part))
        return current

    def _call(self, events: list[Event], fragment: ToolCallFragment) -> None:
        """A fragment continues the open call of its index (else id); any other opens one."""
        call_id, name, arguments = fragment.id, fragment.name, fragment.arguments
        key: object = fragment.index if fragment.index is not None else call_id
        current = self._open
        if key is None and current is not None and current.kind == _CALL:
            key = current.key  # a continuation that names neither its index nor its id
        if current is None or current.kind != _CALL or current.key != key:
            if not name:
                raise MalformedChunk("upstream chunk: a new tool call has no function name")
            self._close(events)
            current = self._open = _Open(_CALL, new_item_id("fc"), len(self._output), key=key,
                                         call_id=call_id or new_item_id("call"), name=name)
            if self.request.tools.of(name).kind == FUNCTION:
                item = dict(self._call_item(current), arguments="", status="in_progress")
                events.append(self._event("response.output_item.added",
                                          output_index=current.index, item=item))
                current.announced = True
        if arguments:
            current.text += arguments
            if current.announced:
                events.append(self._event("response.function_call_arguments.delta",
                                          item_id=current.item_id, output_index=current.index,
                                          delta=arguments))

    def _call_item(self, current: _Open) -> dict[str, Any]:
        return call_item(self.request.tools, current.call_id, current.name, current.text,
                         current.item_id)

    def _close(self, events: list[Event], status: str = "completed") -> None:
        current, self._open = self._open, None
        if current is None:
            return
        where = {"item_id": current.item_id, "output_index": current.index}
        if current.kind == _CALL:
            item = dict(self._call_item(current), status=status)
            if current.announced:
                events.append(self._event("response.function_call_arguments.done", **where,
                                          name=item["name"], arguments=current.text))
            else:
                events.append(self._event("response.output_item.added",
                                          output_index=current.index,
                                          item=dict(item, status="in_progress")))
                if item["type"] == "custom_tool_call":
                    events.append(self._event("response.custom_tool_call_input.delta", **where,
                                              delta=item["input"]))
                    events.append(self._event("response.custom_tool_call_input.done", **where,
                                              input=item["input"]))
        elif current.kind == _REASONING:
            item = dict(reasoning_item(current.item_id, current.text), status=status)
            events.append(self._event("response.reasoning_text.done", **where, content_index=0,
                                      text=current.text))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=item["content"][0]))
        else:
            item = message_item(current.item_id, current.text, status)
            events.append(self._event("response.output_text.done", **where, content_index=0,
                                      text=current.text, logprobs=[]))
            events.append(self._event("response.content_part.done", **where, content_index=0,
                                      part=item["content"][0]))
        events.append(self._event("response.output_item.done", output_index=current.index,
                                  item=item))
        self._output.append(item)

    def _terminal(self) -> list[Event]:
        reason = INCOMPLETE_REASONS.get(self._finish or "")
        response = self._response("incomplete" if reason else "completed")
        if reason:
            response["incomplete_details"] = {"reason": reason}
        self.state = State.DONE
        kind = "response.incomplete" if reason else "response.completed"
        return [self._event(kind, response=response)]

    def _response(self, status: str, *, with_open: bool = False) -> dict[str, Any]:
        output = list(self._output)
        if with_open and self._open is not None and self._open.kind == _MESSAGE:
            output.append(message_item(self._open.item_id, self._open.text, "incomplete"))
        usage = self._usage_now() if status != "in_progress" else None
        return response_object(self.response_id, self.model, status, echo=self.request.echo,
                               output=output, created_at=self.created_at, usage=usage)

    def _usage_now(self) -> dict[str, Any]:
        """The upstream's counts when it sent them; else the generated chunks (about one token
        each) and no prompt count."""
        usage = self._usage or ChatChunk()
        prompt, generated = usage.prompt_tokens, usage.completion_tokens
        reasoning = usage.reasoning_tokens
        return usage_of(0 if prompt is None else prompt,
                        self._fragments if generated is None else generated,
                        self._reasoning_fragments if reasoning is None else reasoning,
                        self._cached)

    def _event(self, kind: str, **fields: Any) -> Event:
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return kind, payload


def encode_events(events: list[Event]) -> bytes:
    return b"".join([encode(name, orjson.dumps(payload)) for name, payload in events])


class BridgeTransform(Translating[Event]):
    """The relay's Transform for a translated Responses stream."""

    __slots__ = ("bridge",)

    encode = staticmethod(encode_events)

    def __init__(self, bridge: Bridge) -> None:
        super().__init__(bridge)
        self.bridge = bridge

    def finish(self) -> list[Event]:
        events = self.bridge.finish()
        if self.bridge.state is State.FAILED:
            raise Unfinished(events)  # the bridge's own `error`, then response.failed
        return events

    def failure(self, message: str, error_code: str) -> list[Event]:
        return self.bridge.failed(message, error_code)

    def stall(self, trip: StallTrip) -> list[Event]:
        return self.bridge.stalled(trip)

    def ping(self, what: str | None) -> bytes:
        return comment(f"hal0d: {what}") if what else comment("ping")
