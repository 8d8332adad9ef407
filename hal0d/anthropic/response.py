"""The Anthropic response: a non-streaming OpenAI chat.completion in, a Messages response out.

Pure. Blocks come in the order a streamed answer would have produced them: thinking, text,
tool_use. A body that is not a chat completion is the upstream's fault, so it raises
UpstreamUnavailable (502) rather than anything the client could have caused.

Usage in Anthropic's sense: when the upstream says how much of the prompt it took from its cache
(usage.prompt_tokens_details.cached_tokens, or llama-server's timings), that part is
cache_read_input_tokens and input_tokens is the rest, what the model read (prompt_tokens is the
two together); without a word of a cache input_tokens is the whole prompt and there is no
cache_read_input_tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import orjson

from hal0d.anthropic.stop import anthropic_stop
from hal0d.anthropic.stream import new_message_id, new_tool_use_id
from hal0d.errors import UpstreamInvalid
from hal0d.protocol.usage import cached_tokens, with_timings

__all__ = ["to_anthropic"]


def to_anthropic(
    openai_response: dict[str, Any],
    *,
    model: str,
    stop_sequences: Sequence[str] = (),
    message_id: str | None = None,
) -> dict[str, Any]:
    if not isinstance(openai_response, dict):
        _malformed("not a JSON object")
    choices = openai_response.get("choices")
    if not isinstance(choices, list) or not choices:
        if "error" in openai_response:
            _malformed("it carries an error instead of choices")
        _malformed("choices is missing or empty")
    choice = choices[0]
    if not isinstance(choice, dict) or not isinstance(choice.get("message"), dict):
        _malformed("choices[0].message is not an object")
    message = choice["message"]

    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if reasoning:
        if not isinstance(reasoning, str):
            _malformed("message reasoning is not a string")
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if text:
        if not isinstance(text, str):
            _malformed("message.content is not a string")
        content.append({"type": "text", "text": text})
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list):
        _malformed("message.tool_calls is not a list")
    for call in tool_calls:
        content.append(_tool_use(call))

    stop_reason, stop_sequence = anthropic_stop(choice, stop_sequences, used_tools=bool(tool_calls))
    usage = openai_response.get("usage")
    return {
        "id": message_id or new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(usage if isinstance(usage, dict) else None,
                        openai_response.get("timings")),
    }


def _usage(usage: dict[str, Any] | None, timings: object) -> dict[str, int]:
    usage = with_timings(usage, timings) or {}
    prompt = _count(usage.get("prompt_tokens"))
    out = {"input_tokens": prompt, "output_tokens": _count(usage.get("completion_tokens"))}
    cached = cached_tokens(usage)
    if cached is not None:
        cached = min(cached, prompt)
        out["input_tokens"] = prompt - cached
        out["cache_read_input_tokens"] = cached
    return out


def _tool_use(call: Any) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        _malformed("a tool call has no function object")
    function = call["function"]
    name = function.get("name")
    if not isinstance(name, str) or not name:
        _malformed("a tool call has no function name")
    call_id = call.get("id")
    arguments = function.get("arguments")
    return {
        "type": "tool_use",
        "id": call_id if isinstance(call_id, str) and call_id else new_tool_use_id(),
        "name": name,
        "input": _tool_input(arguments),
    }


def _tool_input(arguments: Any) -> dict[str, Any]:
    # Some servers hand back the arguments already parsed.
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or arguments == "":
        return {}
    if isinstance(arguments, str):
        try:
            parsed = orjson.loads(arguments)
        except orjson.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed
    # Anthropic's input must be an object; keep what the model wrote so nothing is lost.
    return {"_raw": arguments}


def _count(value: Any) -> int:
    return value if type(value) is int and value >= 0 else 0


def _malformed(problem: str) -> NoReturn:
    raise UpstreamInvalid(f"upstream sent a malformed chat completion: {problem}")
