"""A chat completion streamed as llama-server streams it (or, `legacy`, a /v1/completions text
stream): a role-only first chunk, one chunk per token (a tool call's arguments in fragments), a
final chunk with finish_reason, a usage chunk when `stream_options.include_usage` is set,
`timings` on the last chunk, `data: [DONE]`; `stall` and `broken` misbehave after a few tokens.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Any

import orjson
from aiohttp import web

from hal0d_stub.answering import (
    MID_STREAM_TROUBLE,
    TOKENS_BEFORE_TROUBLE,
    misbehave_mid_stream,
    pause,
    sse_response,
)
from hal0d_stub.appkeys import DELAY_KEY
from hal0d_stub.generation import Generation
from hal0d_stub.models import first_tool_name, plan, shell_call, shell_result


async def stream_tokens(request: web.Request, gen: Generation, legacy: bool) -> web.StreamResponse:
    """A streamed chat completion (or, `legacy`, a /v1/completions text stream)."""
    body = gen.body
    delay = request.app[DELAY_KEY]
    response = sse_response()
    await response.prepare(request)
    await gen.turn.prefill()  # llama-server sends the head first, then reads the prompt
    if not legacy:
        await response.write(
            gen.chunk({"index": 0, "delta": {"role": "assistant", "content": None},
                       "finish_reason": None})
        )
    finish: str | None = "stop"
    if gen.model == "tool" and not legacy:
        await stream_tool_call(response, gen, delay)
        finish = "tool_calls"
    elif gen.model == "shell" and not legacy and shell_result(body) is None:
        name, arguments = shell_call(body)
        await stream_tool_call(response, gen, delay, name, fragments(orjson.dumps(arguments)))
        finish = "tool_calls"
    else:
        for kind, text in plan(gen.model, body):
            if gen.completion_tokens >= gen.max_tokens and gen.model != "chatty":
                finish = "length"
                break
            await pause(delay)
            gen.count(text)
            choice: dict[str, Any] = (
                {"index": 0, "text": text, "finish_reason": None} if legacy
                else {"index": 0, "delta": {kind: text}, "finish_reason": None}
            )
            await response.write(gen.chunk(choice))
            if (
                gen.model in MID_STREAM_TROUBLE
                and gen.completion_tokens >= TOKENS_BEFORE_TROUBLE
                and await misbehave_mid_stream(request, gen.model, f"id={gen.id}")
            ):
                return response
    options = body.get("stream_options")
    with_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    if legacy:
        # llama-server ends a text completion stream with one chunk: finish_reason, usage and
        # timings, include_usage or not.
        last = {"index": 0, "text": "", "finish_reason": finish}
        await response.write(gen.chunk(last, usage=gen.usage(), timings=gen.timings()))
    else:
        # timings go on the stream's last chunk: the usage chunk when there is one.
        last = {"index": 0, "delta": {}, "finish_reason": finish}
        await response.write(gen.chunk(last, **({} if with_usage else {"timings": gen.timings()})))
        if with_usage:
            await response.write(gen.chunk({}, usage=gen.usage(), timings=gen.timings()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def fragments(arguments: bytes, size: int = 16) -> list[str]:
    text = arguments.decode()
    return [text[start:start + size] for start in range(0, len(text), size)]


async def stream_tool_call(response: web.StreamResponse, gen: Generation, delay: float,
                           name: str | None = None,
                           pieces: Iterable[str] = ('{"query"', ': "weather', ' in Paris"}'),
                           ) -> None:
    name = name or first_tool_name(gen.body)
    first = {"index": 0, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": name, "arguments": ""}}
    await response.write(
        gen.chunk({"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None})
    )
    for fragment in pieces:
        await pause(delay)
        gen.count(fragment)
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
        await response.write(gen.chunk({"index": 0, "delta": delta, "finish_reason": None}))
