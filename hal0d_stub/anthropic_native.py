"""The Anthropic Messages API served natively (llama-server and vLLM do), when the stub is made
with `anthropic_native`: POST /v1/messages, the same tokens as chat completions in Anthropic's
content blocks and events, and POST /v1/messages/count_tokens. The request's anthropic-version
and anthropic-beta headers go into the log, for the tests to read.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Iterator
from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.answering import (
    MID_STREAM_TROUBLE,
    TOKENS_BEFORE_TROUBLE,
    answer_whole,
    misbehave_mid_stream,
    pause,
    sse_response,
)
from hal0d_stub.appkeys import CONTEXT_KEY, DELAY_KEY, LOG_KEY
from hal0d_stub.context import asked_max_tokens
from hal0d_stub.handling import logged, read_json
from hal0d_stub.models import DEFAULT_MAX_TOKENS, MODELS, plan
from hal0d_stub.prompt import prompt_tokens


def anthropic_tool_name(body: dict[str, Any]) -> str:
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        name = tools[0].get("name")
        if isinstance(name, str):
            return name
    return "lookup"


def anthropic_event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **fields}) + b"\n\n"


def anthropic_blocks(model: str, body: dict[str, Any], limit: int) -> Iterator[tuple[str, str]]:
    """(block type, piece) for each generated token, up to `limit` (chatty: no limit)."""
    if model == "tool":
        for fragment in ('{"query"', ': "weather', ' in Paris"}'):
            yield "tool_use", fragment
        return
    for count, (kind, text) in enumerate(plan(model, body)):
        if count >= limit and model != "chatty":
            return
        yield ("thinking" if kind == "reasoning_content" else "text"), text


def empty_block(kind: str, body: dict[str, Any]) -> dict[str, Any]:
    if kind == "tool_use":
        return {"type": "tool_use", "id": f"toolu_{uuid.uuid4().hex[:20]}",
                "name": anthropic_tool_name(body), "input": {}}
    if kind == "thinking":
        return {"type": "thinking", "thinking": "", "signature": ""}
    return {"type": "text", "text": ""}


DELTA_FIELDS = {"text": ("text_delta", "text"), "thinking": ("thinking_delta", "thinking"),
                "tool_use": ("input_json_delta", "partial_json")}


@logged("messages")
async def native_messages(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    log = request.app[LOG_KEY]
    log.write(f"native-messages anthropic-version={request.headers.get('anthropic-version')} "
              f"anthropic-beta={request.headers.get('anthropic-beta')}")
    if not isinstance(body.get("messages"), list):
        # The body is checked before the model, as real servers validate it (a request without
        # messages is a 400 there, whatever its model).
        return web.json_response({"type": "error", "error": {
            "type": "invalid_request_error", "message": "messages: field required"}}, status=400)
    model = str(body.get("model", ""))
    if model not in MODELS:
        return web.json_response({"type": "error", "error": {
            "type": "not_found_error", "message": f"model {model!r} not found"}}, status=404)
    context, prompt = request.app[CONTEXT_KEY], prompt_tokens(body)
    asked = asked_max_tokens(body, "max_tokens")
    if (refusal := context.refusal(prompt, asked, anthropic=True)) is not None:
        return refusal
    limit = min(asked or DEFAULT_MAX_TOKENS, context.room(prompt))
    message: dict[str, Any] = {
        "id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant",
        "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": prompt, "output_tokens": 0},
    }
    pieces = anthropic_blocks(model, body, limit)
    if not body.get("stream"):
        if model in ("stall", "chatty"):
            return await answer_whole(request, model, b"")
        return await answer_whole(request, model, orjson.dumps(
            native_whole(message, pieces, body, limit)))
    return await native_stream(request, message, pieces, body, limit)


def stop_reason(model: str, output: int, limit: int) -> str:
    return "tool_use" if model == "tool" else ("max_tokens" if output >= limit else "end_turn")


def native_whole(message: dict[str, Any], pieces: Iterable[tuple[str, str]],
                 body: dict[str, Any], limit: int) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    output = 0
    for kind, piece in pieces:
        output += 1
        if not content or content[-1]["type"] != kind:
            content.append(empty_block(kind, body))
        block = content[-1]
        if kind == "tool_use":
            block["_json"] = block.get("_json", "") + piece
        else:
            block[kind] += piece
    for block in content:
        if "_json" in block:
            block["input"] = orjson.loads(block.pop("_json"))
    message["usage"]["output_tokens"] = output
    return {**message, "content": content,
            "stop_reason": stop_reason(message["model"], output, limit)}


async def native_stream(request: web.Request, message: dict[str, Any],
                        pieces: Iterable[tuple[str, str]], body: dict[str, Any],
                        limit: int) -> web.StreamResponse:
    model = message["model"]
    response = sse_response()
    await response.prepare(request)
    await response.write(anthropic_event("message_start", message=message))
    index, open_kind, output = -1, None, 0
    for kind, piece in pieces:
        if kind != open_kind:
            if open_kind is not None:
                await response.write(anthropic_event("content_block_stop", index=index))
            index, open_kind = index + 1, kind
            await response.write(anthropic_event(
                "content_block_start", index=index, content_block=empty_block(kind, body)))
        await pause(request.app[DELAY_KEY])
        output += 1
        delta_type, field_name = DELTA_FIELDS[kind]
        await response.write(anthropic_event(
            "content_block_delta", index=index, delta={"type": delta_type, field_name: piece}))
        if (
            model in MID_STREAM_TROUBLE
            and output >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, model, f"id={message['id']}")
        ):
            return response
    if open_kind is not None:
        await response.write(anthropic_event("content_block_stop", index=index))
    await response.write(anthropic_event(
        "message_delta", delta={"stop_reason": stop_reason(model, output, limit),
                                "stop_sequence": None},
        usage={"input_tokens": message["usage"]["input_tokens"], "output_tokens": output}))
    await response.write(anthropic_event("message_stop"))
    await response.write_eof()
    return response


async def native_count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    request.app[LOG_KEY].write("native-count-tokens")
    return web.json_response({"input_tokens": prompt_tokens(body)})
