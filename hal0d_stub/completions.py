"""POST /v1/chat/completions and /v1/completions: the prompt checked against the context first
(refused as llama-server, or vLLM, refuses it), then a turn on a server slot for the answer,
streamed (completion_stream.py) or whole (generation.py). Only chat completions refuse a model
name the stub does not have.
"""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.answering import answer_whole
from hal0d_stub.appkeys import ALIASES_KEY, CONTEXT_KEY, SLOTS_KEY
from hal0d_stub.completion_stream import stream_tokens
from hal0d_stub.context import asked_max_tokens
from hal0d_stub.generation import Generation, complete_chat, complete_text
from hal0d_stub.handling import error_body, logged, read_json
from hal0d_stub.models import MODELS
from hal0d_stub.prompt import prompt_text
from hal0d_stub.slots import token_ids


async def complete(request: web.Request, model: str, body: dict[str, Any],
                   legacy: bool) -> web.StreamResponse:
    """A chat completion (or, `legacy`, a text completion) on a server slot, held until the
    answer is over or its client gone. With --alias the stub is one model, as llama-server:
    any name asked is served (as "chat" unless it is one of the stub's own), and the answer
    carries the first alias in sorted order."""
    slots = request.app[SLOTS_KEY]
    aliases = request.app[ALIASES_KEY]
    context = request.app[CONTEXT_KEY]
    if aliases and model not in MODELS:
        model = "chat"
    prompt = token_ids(prompt_text(body))
    if (refusal := context.refusal(len(prompt), asked_max_tokens(body))) is not None:
        return refusal  # before any slot is taken: the prompt is never read
    async with slots.turn(prompt, body) as turn:
        gen = Generation(model, body, "text_completion" if legacy else "chat.completion.chunk",
                         turn, aliases[0] if aliases else None, room=context.room(len(prompt)))
        if body.get("stream"):
            return await stream_tokens(request, gen, legacy=legacy)
        await turn.prefill()
        answer = complete_text(gen) if legacy else complete_chat(gen)
        return await answer_whole(request, model, orjson.dumps(answer))


@logged("chat")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = str(body.get("model", ""))
    if model not in MODELS and not request.app[ALIASES_KEY]:
        return web.json_response(
            error_body(f"model {model!r} not found", "not_found_error"), status=404
        )
    return await complete(request, model, body, legacy=False)


@logged("completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    return await complete(request, str(body.get("model", "chat")), body, legacy=True)
