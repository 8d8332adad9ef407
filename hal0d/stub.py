"""The stub upstream: an OpenAI-compatible server for the demo, the tests and the benchmark.

It streams SSE the way llama-server does (a role-only first chunk, one chunk per token, a final
chunk with finish_reason, a usage chunk when `stream_options.include_usage` is set, `data: [DONE]`)
and misbehaves on demand through its model names:

    reasoning   reasoning_content tokens, then content tokens ("long" as the last user message:
                content until max_tokens)
    chat        content only          think-only  reasoning_content only
    tool        calls the first tool of the request, arguments streamed in fragments
    stall       a few tokens, then silence with the connection open
    chatty      content forever, finish_reason always null
    broken      a few tokens, then the connection is cut

Each request appends lines to --log: `start`, then `end` or `cancelled` (the client went away
before the answer was complete): the tests and the seed's Verify commands read them.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import hdrs, web

MODELS = ("reasoning", "chat", "think-only", "tool", "stall", "chatty", "broken")
REASONING_TEXT = "The user greets me. A short friendly answer fits best here."
CONTENT_TEXT = "Hello! I am the hal0d stub upstream. How can I help you today?"
LONG_WORDS = ["and", "the", "model", "keeps", "talking", "about", "nothing", "in", "particular"]
DEFAULT_MAX_TOKENS = 256

class StubLog:
    """Line-per-event log, flushed at once so a test can read it while the stub runs."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a", buffering=1, encoding="utf-8") if path else None

    def write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.time():.3f} {line}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


LOG_KEY = web.AppKey("stub_log", StubLog)
DELAY_KEY = web.AppKey("stub_delay", float)


def words(text: str) -> list[str]:
    """Split text into word tokens that keep their leading space, as tokenizers do."""
    parts = text.split(" ")
    return [parts[0]] + [" " + part for part in parts[1:]]


def last_user_text(messages: Any) -> str:
    if not isinstance(messages, list):
        return ""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return " ".join(
                    part.get("text", "") for part in content if isinstance(part, dict)
                )
    return ""


def prompt_tokens(body: dict[str, Any]) -> int:
    messages = body.get("messages")
    text = " ".join(
        str(m.get("content", "")) for m in messages if isinstance(m, dict)
    ) if isinstance(messages, list) else str(body.get("prompt", ""))
    # A chat template adds a few tokens around each message; be roughly llama-like.
    return len(text.split()) + 4 * (len(messages) if isinstance(messages, list) else 1)


def plan(model: str, body: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """The (kind, text) tokens the stub generates for a request, kind being a delta field."""
    if model in ("reasoning", "think-only"):
        yield from (("reasoning_content", w) for w in words(REASONING_TEXT))
    if model == "think-only":
        return
    if model == "reasoning" and last_user_text(body.get("messages")).strip() == "long":
        yield from (("content", w) for w in itertools.cycle(words(" ".join(LONG_WORDS))))
    if model == "chatty":
        yield from (("content", w) for w in itertools.cycle(words(CONTENT_TEXT)))
    yield from (("content", w) for w in words(CONTENT_TEXT))


class Generation:
    """One streamed answer: tokens, limits, and the chunk envelope."""

    def __init__(self, model: str, body: dict[str, Any], object_name: str) -> None:
        self.model = model
        self.body = body
        self.object = object_name
        self.id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        self.created = int(time.time())
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        self.max_tokens = max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else (
            DEFAULT_MAX_TOKENS
        )
        self.completion_tokens = 0

    def chunk(self, choice: dict[str, Any], **extra: Any) -> bytes:
        payload = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": [choice] if choice else [],
            **extra,
        }
        return b"data: " + orjson.dumps(payload) + b"\n\n"

    def usage(self) -> dict[str, int]:
        prompt = prompt_tokens(self.body)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.completion_tokens,
            "total_tokens": prompt + self.completion_tokens,
        }


async def _pause(delay: float) -> None:
    # Yield to the loop even without pacing so cancellation and other requests get a turn.
    await asyncio.sleep(delay)


async def stream_chat(
    request: web.Request, gen: Generation, log: StubLog, delay: float
) -> web.StreamResponse:
    body = gen.body
    response = web.StreamResponse(
        headers={hdrs.CONTENT_TYPE: "text/event-stream", hdrs.CACHE_CONTROL: "no-cache"}
    )
    await response.prepare(request)
    await response.write(
        gen.chunk({"index": 0, "delta": {"role": "assistant", "content": None},
                   "finish_reason": None})
    )
    finish: str | None = "stop"
    if gen.model == "tool":
        await stream_tool_call(response, gen, delay)
        finish = "tool_calls"
    else:
        for kind, text in plan(gen.model, body):
            if gen.completion_tokens >= gen.max_tokens and gen.model != "chatty":
                finish = "length"
                break
            await _pause(delay)
            gen.completion_tokens += 1
            await response.write(
                gen.chunk({"index": 0, "delta": {kind: text}, "finish_reason": None})
            )
            if gen.model in ("stall", "broken") and gen.completion_tokens >= 3:
                if gen.model == "stall":
                    log.write(f"stalling id={gen.id}")
                    await asyncio.Event().wait()  # silence until the client goes away
                log.write(f"breaking id={gen.id}")
                assert request.transport is not None
                request.transport.abort()
                return response
    await response.write(
        gen.chunk({"index": 0, "delta": {}, "finish_reason": finish},
                  timings={"predicted_n": gen.completion_tokens})
    )
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        await response.write(gen.chunk({}, usage=gen.usage()))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def first_tool_name(body: dict[str, Any]) -> str:
    tools = body.get("tools")
    if isinstance(tools, list) and tools and isinstance(tools[0], dict):
        function = tools[0].get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
    return "lookup"


async def stream_tool_call(response: web.StreamResponse, gen: Generation, delay: float) -> None:
    name = first_tool_name(gen.body)
    first = {"index": 0, "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
             "function": {"name": name, "arguments": ""}}
    await response.write(
        gen.chunk({"index": 0, "delta": {"tool_calls": [first]}, "finish_reason": None})
    )
    for fragment in ('{"query"', ': "weather', ' in Paris"}'):
        await _pause(delay)
        gen.completion_tokens += 1
        delta = {"tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
        await response.write(gen.chunk({"index": 0, "delta": delta, "finish_reason": None}))


def complete_chat(gen: Generation) -> dict[str, Any]:
    reasoning: list[str] = []
    content: list[str] = []
    finish = "stop"
    message: dict[str, Any] = {"role": "assistant"}
    if gen.model == "tool":
        message["content"] = None
        message["tool_calls"] = [{
            "id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
            "function": {
                "name": first_tool_name(gen.body),
                "arguments": '{"query": "weather in Paris"}',
            },
        }]
        gen.completion_tokens = 3
        finish = "tool_calls"
    else:
        for kind, text in plan(gen.model, gen.body):
            if gen.completion_tokens >= gen.max_tokens:
                finish = "length"
                break
            gen.completion_tokens += 1
            (reasoning if kind == "reasoning_content" else content).append(text)
        message["content"] = "".join(content) if content else None
        if reasoning:
            message["reasoning_content"] = "".join(reasoning)
    return {
        "id": gen.id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": gen.usage(),
    }


async def read_json(request: web.Request) -> dict[str, Any]:
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        raise web.HTTPBadRequest(text='{"error":{"message":"invalid JSON"}}',
                                 content_type="application/json") from None
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text='{"error":{"message":"body must be an object"}}',
                                 content_type="application/json")
    return body


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def logged(endpoint: str) -> Callable[[Handler], Handler]:
    """Wrap a handler with the start / end / cancelled log lines."""

    def wrap(handler: Handler) -> Handler:
        async def run(request: web.Request) -> web.StreamResponse:
            log = request.app[LOG_KEY]
            rid = uuid.uuid4().hex[:8]
            log.write(f"start rid={rid} endpoint={endpoint}")
            try:
                response = await handler(request)
            except asyncio.CancelledError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (client went away)")
                raise
            except ConnectionResetError:
                log.write(f"cancelled rid={rid} endpoint={endpoint} (connection reset)")
                raise
            log.write(f"end rid={rid} endpoint={endpoint} status={response.status}")
            return response

        return run

    return wrap


@logged("chat")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    model = str(body.get("model", ""))
    if model not in MODELS:
        return web.json_response(
            {"error": {"message": f"model {model!r} not found", "type": "not_found_error"}},
            status=404,
        )
    gen = Generation(model, body, "chat.completion.chunk")
    if body.get("stream"):
        return await stream_chat(request, gen, request.app[LOG_KEY], request.app[DELAY_KEY])
    if model in ("stall", "chatty"):
        await asyncio.Event().wait()
    return web.json_response(complete_chat(gen))


@logged("completions")
async def completions(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    gen = Generation(str(body.get("model", "chat")), body, "text_completion")
    tokens = [text for _, text in plan(gen.model, body)][: gen.max_tokens]
    if not body.get("stream"):
        gen.completion_tokens = len(tokens)
        return web.json_response({
            "id": gen.id, "object": "text_completion", "created": gen.created,
            "model": gen.model, "usage": gen.usage(),
            "choices": [{"index": 0, "text": "".join(tokens), "finish_reason": "stop"}],
        })
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
    await response.prepare(request)
    for text in tokens:
        await _pause(request.app[DELAY_KEY])
        gen.completion_tokens += 1
        await response.write(gen.chunk({"index": 0, "text": text, "finish_reason": None}))
        if gen.model == "stall" and gen.completion_tokens >= 3:
            await asyncio.Event().wait()
    await response.write(gen.chunk({"index": 0, "text": "", "finish_reason": "stop"}))
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


@logged("speech")
async def speech(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "audio/wav"})
    await response.prepare(request)
    frames = 1_000_000 if body.get("model") in ("stall", "chatty") else 8
    for index in range(frames):
        await _pause(request.app[DELAY_KEY])
        await response.write(bytes([index % 256]) * 1024)
        if body.get("model") == "stall" and index >= 2:
            await asyncio.Event().wait()
    await response.write_eof()
    return response


@logged("embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    inputs = body.get("input")
    items = inputs if isinstance(inputs, list) else [inputs]
    data = [
        {"object": "embedding", "index": i,
         "embedding": [((hash(str(item)) >> shift) % 1000) / 1000 for shift in range(8)]}
        for i, item in enumerate(items)
    ]
    return web.json_response({
        "object": "list", "data": data, "model": body.get("model"),
        "usage": {"prompt_tokens": len(items), "total_tokens": len(items)},
    })


async def tokenize(request: web.Request) -> web.Response:
    """llama-server's shape: {"content": text} -> {"tokens": [...]}."""
    body = await read_json(request)
    content = body.get("content")
    if not isinstance(content, str):
        return web.json_response({"error": {"message": "content is required"}}, status=400)
    return web.json_response({"tokens": list(range(len(content.split()) + 4))})


async def models(request: web.Request) -> web.Response:
    return web.json_response(
        {"object": "list",
         "data": [{"id": m, "object": "model", "owned_by": "hal0d-stub"} for m in MODELS]}
    )


def make_stub_app(log_path: Path | None = None, delay: float = 0.02) -> web.Application:
    app = web.Application()
    app[LOG_KEY] = StubLog(log_path)
    app[DELAY_KEY] = delay
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/audio/speech", speech)
    app.router.add_post("/v1/embeddings", embeddings)
    app.router.add_post("/tokenize", tokenize)

    async def close_log(app: web.Application) -> None:
        app[LOG_KEY].close()

    app.on_cleanup.append(close_log)
    return app


def run_stub(host: str, port: int, log_path: Path | None, delay: float) -> None:
    web.run_app(
        make_stub_app(log_path, delay),
        host=host,
        port=port,
        handler_cancellation=True,
        access_log=None,
        print=None,
    )
