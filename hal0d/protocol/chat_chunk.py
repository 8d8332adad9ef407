"""One upstream chat-completion stream chunk, read once: every field checked, what it says returned.

Every translated surface (Anthropic, Ollama, the Responses bridge) is fed the same thing, one
parsed `data:` frame of an OpenAI-style `/v1/chat/completions` stream, and each must refuse the
same broken shapes with the same words. `read_chunk` is that one reading; the translators keep
only their own surface's rules (which fragment opens which block, what may follow a finish).

What a chunk may carry, and what each field must be (null is the same as absent):

    error, or object == "error"              the upstream failed      refused, with its message
    choices                                  list (may be empty)
    choices[0]                               object
      .delta                                 object
        .content                             text                     str
        .reasoning_content                   reasoning (llama-server) str
        .reasoning                           reasoning (vLLM's name)  str
        .tool_calls[]                        tool call fragments      list of objects
          .index  .id                                                 int, str
          .function  .name  .arguments                                object, str, str
      .finish_reason                         why generation stopped   str
    usage                                    the upstream's counts    object
      .prompt_tokens  .completion_tokens                              int >= 0
      .completion_tokens_details.reasoning_tokens                     object, int >= 0
      .prompt_tokens_details.cached_tokens   the prompt's cached part read, not checked
    timings.cache_n                          the same, llama-server's read, not checked

A field of another type is a MalformedChunk, raised before a translator changes any state, so
the stream can end with the message; the cached part is only reported, so a figure of it that is
no count is none (protocol/usage.py reads it). Fields not listed (role, logprobs, the rest of
llama-server's timings) are not read, and only choices[0] is: hal0d never asks for more than one
choice. Null counts as absent because real servers send it: `"finish_reason": null` until the
last chunk (all of them), `"content": null` beside the role (llama-server), `"usage": null` on
every chunk before the usage one (OpenAI, vLLM).

`chunk_of` is the step before, the same for every translating transform: one relayed SSE event
as its parsed JSON, `[DONE]` as None, text that is not UTF-8 or not JSON refused (Unreadable).

Pure: stdlib and orjson only (and hal0d.errors, the base layer's reading of an upstream's error
body, and protocol/usage.py's of the cached part).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from hal0d.errors import upstream_message
from hal0d.protocol.sse import Event
from hal0d.protocol.usage import cached_tokens

__all__ = ["ChatChunk", "MalformedChunk", "ToolCallFragment", "Unreadable", "chunk_of",
           "read_chunk"]


class MalformedChunk(ValueError):
    """The upstream sent something that is not a usable chat.completion.chunk."""


class Unreadable(ValueError):
    """An upstream event that is no chunk at all: text that is not UTF-8, or not JSON."""


def chunk_of(event: Event) -> Any | None:
    """One relayed SSE event's parsed JSON, None for `data: [DONE]`; Unreadable when it is text
    that is not UTF-8, or not JSON."""
    if event.invalid_utf8:
        raise Unreadable("upstream sent text that is not UTF-8")
    if event.data == "[DONE]":
        return None
    try:
        return orjson.loads(event.data)
    except orjson.JSONDecodeError:
        raise Unreadable("upstream sent a chunk that is not JSON") from None


@dataclass(frozen=True, slots=True)
class ToolCallFragment:
    """One entry of `delta.tool_calls`: a call's start (it names the function) or more of its
    arguments. Which call a fragment belongs to (by index, by id, or the open one) is the
    translator's rule, since the surfaces differ in what they may reopen."""

    index: int | None
    id: str | None
    name: str | None
    arguments: str  # the next piece of the arguments' JSON text; "" when the fragment has none


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which doubles the
# cost of reading a chunk, and one is built per upstream chunk. Nothing writes to one.
@dataclass(slots=True)
class ChatChunk:
    """What one upstream chunk says, every field checked."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: tuple[ToolCallFragment, ...] = ()
    finish_reason: str | None = None
    # choices[0] as sent, for what only one surface reads (the Anthropic stop sequence's
    # `stop_reason` / `stopping_word`); None when the chunk has no choice.
    choice: dict[str, Any] | None = None
    has_usage: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    reasoning_tokens: int | None = None
    # Of the prompt, what the upstream took from its cache: from usage or llama-server's timings
    # (which come on the last chunk, with or without usage).
    cached_tokens: int | None = None


def read_chunk(obj: object) -> ChatChunk:
    """What one parsed chunk says; raises MalformedChunk naming the first field that is wrong.

    The fields nearly every chunk has are read in this one function, since it runs once per
    upstream chunk; tool calls and usage, in a few chunks of a stream, have helpers below.
    """
    if not isinstance(obj, dict):
        raise MalformedChunk("upstream chunk is not a JSON object")
    # Refused even beside choices: a proxy that reports a failure mid-stream next to a
    # finish_reason must not make a cut answer look finished.
    if "error" in obj and obj["error"] is not None:
        raise _upstream_error(obj)
    choice = content = reasoning = finish = None
    tool_calls: tuple[ToolCallFragment, ...] = ()
    choices = obj.get("choices")
    if choices:
        if not isinstance(choices, list):
            raise MalformedChunk("upstream chunk: choices is not a list")
        choice = choices[0]
        if not isinstance(choice, dict):
            raise MalformedChunk("upstream chunk: choices[0] is not an object")
        delta = choice.get("delta")
        if delta is not None:
            if not isinstance(delta, dict):
                raise MalformedChunk("upstream chunk: delta is not an object")
            content = delta.get("content")
            if content is not None and not isinstance(content, str):
                raise MalformedChunk("upstream chunk: delta.content is not a string")
            # vLLM renamed reasoning_content to reasoning; versions sending both send the same.
            reasoning = delta.get("reasoning_content")
            renamed = delta.get("reasoning")
            if (reasoning is not None and not isinstance(reasoning, str)) or (
                renamed is not None and not isinstance(renamed, str)
            ):
                raise MalformedChunk("upstream chunk: delta reasoning is not a string")
            reasoning = reasoning or renamed
            raw_calls = delta.get("tool_calls")
            if raw_calls is not None:
                tool_calls = _tool_calls(raw_calls)
        finish = choice.get("finish_reason")
        if finish is not None and not isinstance(finish, str):
            raise MalformedChunk("upstream chunk: finish_reason is not a string")
    elif choices is not None and not isinstance(choices, list):
        raise MalformedChunk("upstream chunk: choices is not a list")
    elif obj.get("object") == "error":  # vLLM's error, which has no choices
        raise _upstream_error(obj)
    usage, timings = obj.get("usage"), obj.get("timings")
    if usage is None:
        if timings is None:
            return ChatChunk(content, reasoning, tool_calls, finish, choice)
        return ChatChunk(content, reasoning, tool_calls, finish, choice,
                         cached_tokens=cached_tokens(None, timings))
    prompt, completion, reasoning_tokens = _read_usage(usage)
    return ChatChunk(content, reasoning, tool_calls, finish, choice, True, prompt, completion,
                     reasoning_tokens, cached_tokens(usage, timings))


def _upstream_error(obj: dict[str, Any]) -> MalformedChunk:
    message = upstream_message(obj)
    return MalformedChunk(f"upstream reported an error: {message or 'no message'}")


def _tool_calls(raw: object) -> tuple[ToolCallFragment, ...]:
    if not isinstance(raw, list):
        raise MalformedChunk("upstream chunk: delta.tool_calls is not a list")
    fragments = []
    for call in raw:
        if not isinstance(call, dict):
            raise MalformedChunk("upstream chunk: a tool call is not an object")
        function = call.get("function")
        if function is None:
            function = {}  # a fragment that only repeats the call's index or id
        elif not isinstance(function, dict):
            raise MalformedChunk("upstream chunk: tool call function is not an object")
        index = call.get("index")
        call_id = call.get("id")
        name = function.get("name")
        arguments = function.get("arguments")
        if index is not None and type(index) is not int:  # not isinstance: True is no index
            raise MalformedChunk("upstream chunk: tool call index is not an integer")
        if not _is_str(call_id) or not _is_str(name) or not _is_str(arguments):
            raise MalformedChunk("upstream chunk: tool call id, name or arguments is not a string")
        fragments.append(ToolCallFragment(index, call_id, name, arguments or ""))
    return tuple(fragments)


def _read_usage(usage: object) -> tuple[int | None, int | None, int | None]:
    """(prompt_tokens, completion_tokens, reasoning_tokens) of a usage object."""
    if not isinstance(usage, dict):
        raise MalformedChunk("upstream chunk: usage is not an object")
    prompt = usage.get("prompt_tokens")
    completion = usage.get("completion_tokens")
    if not _is_count(prompt) or not _is_count(completion):
        raise MalformedChunk("upstream chunk: usage token counts are not integers")
    details = usage.get("completion_tokens_details")
    if details is None:
        return prompt, completion, None
    if not isinstance(details, dict):
        raise MalformedChunk("upstream chunk: usage.completion_tokens_details is not an object")
    reasoning = details.get("reasoning_tokens")
    if not _is_count(reasoning):
        raise MalformedChunk("upstream chunk: usage token counts are not integers")
    return prompt, completion, reasoning


def _is_count(value: object) -> bool:
    return value is None or (type(value) is int and value >= 0)


def _is_str(value: object) -> bool:
    return value is None or isinstance(value, str)
