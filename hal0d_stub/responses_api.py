"""The OpenAI Responses API (POST /v1/responses), as vLLM and llama-server serve it: the tokens of
a chat completion (text only), streamed as named SSE events (`event: response.output_text.delta`
...), each with its `type` and `sequence_number`, and the answers kept for GET and DELETE
/v1/responses/{id}. A stub made with `chat_only` serves none of it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import orjson
from aiohttp import hdrs, web

from hal0d_stub.answering import (
    MID_STREAM_TROUBLE,
    TOKENS_BEFORE_TROUBLE,
    answer_whole,
    misbehave_mid_stream,
    pause,
    sse_response,
)
from hal0d_stub.appkeys import CONTEXT_KEY, DELAY_KEY
from hal0d_stub.context import asked_max_tokens
from hal0d_stub.handling import bad_request, error_body, logged, read_json
from hal0d_stub.models import DEFAULT_MAX_TOKENS, MODELS, plan
from hal0d_stub.prompt import prompt_tokens

# The answers are kept, a bounded few (the oldest forgotten first), for GET and DELETE
# /v1/responses/{id}.
STORED_RESPONSES = 1000
RESPONSES_KEY = web.AppKey("stub_responses", dict)


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses `input` as chat messages, so plan() and prompt_tokens() read it."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if isinstance(given, list):
        return [item for item in given if isinstance(item, dict)]
    return []


class ResponseGeneration:
    """One Responses answer: the response object as it stands, and the events of its stream."""

    def __init__(self, model: str, body: dict[str, Any], room: int = DEFAULT_MAX_TOKENS
                 ) -> None:
        self.model = model
        self.chat_body = {"messages": responses_messages(body)}
        self.id = f"resp_{uuid.uuid4().hex[:24]}"
        self.item_id = f"msg_{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        limit = asked_max_tokens(body, "max_output_tokens") or DEFAULT_MAX_TOKENS
        self.max_tokens = min(limit, room)  # never past the context's end
        self.sequence = 0
        self.text = ""
        self.output_tokens = 0

    def tokens(self) -> Iterator[str]:
        """The content tokens (the Responses stub answers text only); the limit ends them."""
        for kind, text in plan(self.model, self.chat_body):
            if kind != "content":
                continue
            if self.output_tokens >= self.max_tokens and self.model != "chatty":
                return
            self.output_tokens += 1
            yield text

    def message(self, status: str) -> dict[str, Any]:
        return {"id": self.item_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": self.text, "annotations": []}]}

    def response(self, status: str) -> dict[str, Any]:
        done = status != "in_progress"
        input_tokens = prompt_tokens(self.chat_body)
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": [self.message("completed")] if done else [],
            "error": None, "incomplete_details": None, "instructions": None, "metadata": {},
            "parallel_tool_calls": True, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto",
            "tools": [], "text": {"format": {"type": "text"}},
            "usage": {
                "input_tokens": input_tokens, "output_tokens": self.output_tokens,
                "total_tokens": input_tokens + self.output_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            } if done else None,
        }

    def event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"


def store_response(request: web.Request, response: dict[str, Any]) -> None:
    stored = request.app[RESPONSES_KEY]
    stored[response["id"]] = response
    while len(stored) > STORED_RESPONSES:
        del stored[next(iter(stored))]


async def stream_response(request: web.Request, gen: ResponseGeneration) -> web.StreamResponse:
    delay = request.app[DELAY_KEY]
    response = sse_response()
    await response.prepare(request)
    where = {"item_id": gen.item_id, "output_index": 0, "content_index": 0}
    opening = [
        gen.event("response.created", response=gen.response("in_progress")),
        gen.event("response.in_progress", response=gen.response("in_progress")),
        gen.event("response.output_item.added", output_index=0, item={
            "id": gen.item_id, "type": "message", "status": "in_progress", "role": "assistant",
            "content": []}),
        gen.event("response.content_part.added", item_id=gen.item_id, output_index=0,
                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}),
    ]
    await response.write(b"".join(opening))
    for text in gen.tokens():
        await pause(delay)
        gen.text += text
        await response.write(
            gen.event("response.output_text.delta", **where, delta=text, logprobs=[])
        )
        if (
            gen.model in MID_STREAM_TROUBLE
            and gen.output_tokens >= TOKENS_BEFORE_TROUBLE
            and await misbehave_mid_stream(request, gen.model, f"id={gen.id}")
        ):
            return response
    final = gen.response("completed")
    store_response(request, final)
    closing = [
        gen.event("response.output_text.done", **where, text=gen.text, logprobs=[]),
        gen.event("response.content_part.done", **where,
                  part={"type": "output_text", "text": gen.text, "annotations": []}),
        gen.event("response.output_item.done", output_index=0, item=gen.message("completed")),
        gen.event("response.completed", response=final),
    ]
    await response.write(b"".join(closing))
    await response.write_eof()
    return response


@logged("responses")
async def responses(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    if "input" not in body:
        # The body is checked before the model, as real servers validate it: an empty request
        # is a 400 (which is how hal0d's `responses = "auto"` tells the endpoint is there).
        raise bad_request("'input' is required")
    model = str(body.get("model", ""))
    if model not in MODELS:
        return web.json_response(
            error_body(f"model {model!r} not found", "not_found_error"), status=404
        )
    context = request.app[CONTEXT_KEY]
    prompt = prompt_tokens({"messages": responses_messages(body)})
    refusal = context.refusal(prompt, asked_max_tokens(body, "max_output_tokens"))
    if refusal is not None:
        return refusal
    gen = ResponseGeneration(model, body, context.room(prompt))
    if body.get("stream"):
        return await stream_response(request, gen)
    if model not in ("stall", "chatty", "broken"):
        gen.text = "".join(gen.tokens())
    final = gen.response("completed")
    store_response(request, final)
    return await answer_whole(request, model, orjson.dumps(final))


async def stored_response(request: web.Request) -> web.Response:
    """GET /v1/responses/{id}: a kept answer; DELETE forgets it."""
    response_id = request.match_info["id"]
    stored = request.app[RESPONSES_KEY]
    if response_id not in stored:
        return web.json_response(
            error_body(f"no response {response_id!r}", "not_found_error"), status=404
        )
    if request.method == hdrs.METH_DELETE:
        del stored[response_id]
        return web.json_response({"id": response_id, "object": "response", "deleted": True})
    return web.json_response(stored[response_id])
