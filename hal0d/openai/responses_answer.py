"""A whole chat completion back as a Responses API answer (pure), for a slot whose upstream has
no /v1/responses (`[[slots]] responses = "translate"`); the request's way there is
responses_request.py. Also the pieces of a Responses answer that the stream's translation
(responses_bridge.py) builds its events from: the ids, the usage, the response object and its
output items.

    chat completion                        Responses answer
    message.reasoning_content (or          a reasoning item first
      reasoning)
    message.content                        a message item with one output_text part
    message.tool_calls                     an item of the kind its tool was (the ToolMap kept
                                             from the request says which): function_call,
                                             custom_tool_call, or local_shell_call
    usage (and llama-server's timings)     usage, with input_tokens_details.cached_tokens
    finish_reason "length",                status "incomplete", with incomplete_details.reason
      "content_filter"
    (the request's instructions, tools,    echoed into the response object as given
      text, metadata, ...)
"""

from __future__ import annotations

import secrets
import time
from typing import Any

import orjson

from hal0d.openai.responses_request import CUSTOM, LOCAL_SHELL, ChatRequest, ToolMap
from hal0d.protocol.usage import cached_tokens, with_timings

__all__ = [
    "new_item_id",
    "new_response_id",
    "response_object",
    "to_response",
    "usage_of",
]


def new_response_id() -> str:
    return "resp_" + secrets.token_hex(12)


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage_of(input_tokens: int, output_tokens: int, reasoning_tokens: int = 0,
             cached_tokens: int | None = None) -> dict[str, Any]:
    """A Responses usage. As in chat completions, input_tokens is the whole prompt and
    input_tokens_details.cached_tokens the part of it the upstream took from its cache (0 when
    it did not say)."""
    cached = min(cached_tokens or 0, input_tokens)
    return {"input_tokens": input_tokens, "output_tokens": output_tokens,
            "total_tokens": input_tokens + output_tokens,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens}}


def response_object(response_id: str, model: str, status: str, *, echo: dict[str, Any],
                    output: list[dict[str, Any]] | None, created_at: int | None = None,
                    usage: dict[str, Any] | None = None) -> dict[str, Any]:
    response: dict[str, Any] = {
        "id": response_id, "object": "response",
        "created_at": created_at if created_at is not None else int(time.time()),
        "status": status, "model": model, "output": output if output is not None else [],
        "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
        "parallel_tool_calls": True, "temperature": None, "top_p": None, "tool_choice": "auto",
        "tools": [], "text": {"format": {"type": "text"}}, "usage": usage, "store": False,
    }
    response.update(echo)
    return response


INCOMPLETE_REASONS = {"length": "max_output_tokens", "content_filter": "content_filter"}


def call_item(tools: ToolMap, call_id: str, chat_name: str, arguments: str,
              item_id: str | None = None) -> dict[str, Any]:
    """A chat tool call as the Responses item its tool is."""
    tool = tools.of(chat_name)
    if tool.kind == LOCAL_SHELL:
        parsed = loads_object(arguments)
        command = parsed.get("command")
        action: dict[str, Any] = {"type": "exec",
                  "command": command if isinstance(command, list) else [str(command or "")],
                  "working_directory": parsed.get("workdir"),
                  "timeout_ms": parsed.get("timeout_ms"), "env": {}, "user": None}
        return {"id": item_id or new_item_id("lsh"), "type": "local_shell_call",
                "call_id": call_id, "status": "completed", "action": action}
    if tool.kind == CUSTOM:
        given = loads_object(arguments).get("input")
        item = {"id": item_id or new_item_id("ctc"), "type": "custom_tool_call",
                "call_id": call_id, "name": tool.name, "status": "completed",
                "input": given if isinstance(given, str) else arguments}
    else:
        item = {"id": item_id or new_item_id("fc"), "type": "function_call", "call_id": call_id,
                "name": tool.name, "arguments": arguments, "status": "completed"}
    if tool.namespace is not None:
        item["namespace"] = tool.namespace
    return item


def loads_object(text: str) -> dict[str, Any]:
    try:
        parsed = orjson.loads(text or "{}")
    except orjson.JSONDecodeError:
        return {}
    return parsed if isinstance(parsed, dict) else {}


def to_response(completion: Any, request: ChatRequest, *, model: str) -> dict[str, Any]:
    """A whole chat completion as a Responses answer; InvalidRequest never, ValueError when
    the completion has no choice to read."""
    if not isinstance(completion, dict) or not isinstance(completion.get("choices"), list) or (
            not completion["choices"] or not isinstance(completion["choices"][0], dict)):
        raise ValueError("the chat completion has no choices[0]")
    choice = completion["choices"][0]
    message: dict[str, Any] = choice["message"] if isinstance(choice.get("message"), dict) else {}
    output: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("reasoning")
    if isinstance(reasoning, str) and reasoning:
        output.append(reasoning_item(new_item_id("rs"), reasoning))
    if isinstance(message.get("content"), str) and message["content"]:
        output.append(message_item(new_item_id("msg"), message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict):
            output.append(call_item(request.tools, str(call.get("id") or new_item_id("call")),
                                    str(function.get("name", "")),
                                    str(function.get("arguments") or "")))
    given = completion["usage"] if isinstance(completion.get("usage"), dict) else None
    usage = with_timings(given, completion.get("timings")) or {}
    prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
    reason = INCOMPLETE_REASONS.get(str(choice.get("finish_reason")))
    response = response_object(
        new_response_id(), model, "incomplete" if reason else "completed", echo=request.echo,
        output=output, usage=usage_of(prompt if isinstance(prompt, int) else 0,
                                      generated if isinstance(generated, int) else 0,
                                      cached_tokens=cached_tokens(usage)))
    if reason:
        response["incomplete_details"] = {"reason": reason}
    return response


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_item(item_id: str, text: str) -> dict[str, Any]:
    return {"id": item_id, "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}
