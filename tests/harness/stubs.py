"""What stands in for a model server: hal0d's own stub (in the test's event loop, or as a slot's
command), purpose-built aiohttp upstreams, and the stream pieces they write."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer

from hal0d_stub.app import make_stub_app
from tests.harness.ports import free_port

STUB_MODELS = ("reasoning", "chat", "think-only", "tool", "stall", "chatty", "broken", "shell")
ROLE_CHUNK = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null}}]}\n\n'
FINISH_CHUNK = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"

# aiohttp_server's: an app in, its started TestServer out.
ServerStarter = Callable[..., Awaitable[TestServer]]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# upstream_app's: routes ("METHOD /path" to handler) in, the upstream's URL out.
Upstream = Callable[[dict[str, Handler]], Awaitable[str]]


def read_log(path: Path) -> str:
    return path.read_text() if path.exists() else ""


@dataclasses.dataclass
class Stub:
    server: TestServer
    log: Path

    @property
    def url(self) -> str:
        return str(self.server.make_url("")).rstrip("/")

    def lines(self) -> list[str]:
        return read_log(self.log).splitlines()


StubFactory = Callable[..., Awaitable[Stub]]


async def serve_stub(aiohttp_server: ServerStarter, folder: Path, delay: float = 0.002,
                     **app_options: Any) -> Stub:
    """The stub in the test's event loop, logging into `folder`; `app_options` go to
    make_stub_app (`props`, `anthropic_native`, ...)."""
    log = folder / f"stub-{free_port()}.log"
    server = await aiohttp_server(make_stub_app(log, delay, **app_options))
    return Stub(server, log)


def stub_command(port: int, log: Path, *extra: str) -> tuple[str, ...]:
    """The stub as a slot's command: a process of its own on `port`."""
    return (sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--log", str(log),
            "--delay", "0.005", *extra)


async def serve_upstream(aiohttp_server: ServerStarter, routes: dict[str, Handler]) -> str:
    """A purpose-built upstream: {"POST /v1/chat/completions": handler, ...}. GET /v1/models
    answers by default so the health probe sees a live slot."""
    app = web.Application()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    if "GET /v1/models" not in routes:
        app.router.add_get("/v1/models", models)
    for key, handler in routes.items():
        method, path = key.split(" ", 1)
        app.router.add_route(method, path, handler)
    server = await aiohttp_server(app)
    return str(server.make_url("")).rstrip("/")


def content_chunk(text: str) -> bytes:
    return (
        b"data: "
        + orjson.dumps(
            {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}
        )
        + b"\n\n"
    )


async def answering_stream(request: web.Request) -> web.StreamResponse:
    """A stream of one chunk, "ok", and its end."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"index":0,"delta":{"content":"ok"},'
                         b'"finish_reason":"stop"}]}\n\ndata: [DONE]\n\n')
    return response


def answering_first(status: int, app: web.Application, path: str) -> web.Application:
    """`app` with its first POST to `path` answered `status` whatever it has there, as a server
    that is still loading its model (503), limits its callers (429) or wants a key (401)."""
    first = True

    @web.middleware
    async def first_answer(request: web.Request, handler: Any) -> web.StreamResponse:
        nonlocal first
        if request.method == "POST" and request.path == path and first:
            first = False
            return web.json_response({"error": {"message": "not now"}}, status=status)
        return await handler(request)

    app.middlewares.append(first_answer)
    return app


def recording_upstream(seen: list[tuple[str, dict[str, str]]]) -> dict[str, Any]:
    """An upstream that records the headers of every request it gets, probes included."""

    def record(request: web.Request) -> None:
        seen.append((f"{request.method} {request.path}", dict(request.headers)))

    async def chat(request: web.Request) -> web.StreamResponse:
        record(request)
        body = await request.json()
        if not body.get("stream"):
            return web.json_response({
                "id": "x", "object": "chat.completion", "model": body["model"],
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "hi"}}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            })
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for delta, finish in (({"content": "hi"}, None), ({}, "stop")):
            chunk = {"id": "x", "object": "chat.completion.chunk", "model": body["model"],
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    async def tokenize(request: web.Request) -> web.Response:
        record(request)
        return web.json_response({"tokens": [1, 2, 3]})

    async def models(request: web.Request) -> web.Response:
        record(request)
        return web.json_response({"object": "list", "data": []})

    return {"POST /v1/chat/completions": chat, "POST /tokenize": tokenize,
            "POST /extras/tokenize/count": tokenize, "GET /v1/models": models}
