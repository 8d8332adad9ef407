"""The Ollama API, on its own listener ([ollama] listen): /, /api/version, /api/tags, /api/show,
/api/ps, /api/chat, /api/generate, /api/embed, /api/embeddings; pull, push, create, copy and
delete are refused (hal0d serves its slots' models, it does not manage model files).

Chat and generate are translated to chat completions (hal0d/ollama/request.py) and sent through
the forward path like any other request; a stream comes back through the relay's Ollama
transform as NDJSON. Before the first line every failure is a real HTTP status with Ollama's
`{"error": ...}` body (the lifecycle middleware renders it); after it, one `{"error": ...}`
line ends the stream. `keep_alive` is told to the lifecycle manager under the lease: it sets
this load's idle timer of an on-demand slot.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

import aiohttp
import orjson
from aiohttp import hdrs, web

from hal0d.appkeys import DISPATCH, LIFECYCLE, OLLAMA_THINKERS, RUNTIME, SLOTS
from hal0d.errors import InvalidRequest, NoRoute, UpstreamInvalid
from hal0d.forward import Forward
from hal0d.handlers.anthropic import upstream_status_error
from hal0d.handlers.body import parse_json_object, read_body
from hal0d.keys import KEY
from hal0d.lifecycle.slots import SlotState
from hal0d.logs import get_logger
from hal0d.ollama import response as shapes
from hal0d.ollama.request import (
    LOAD_OPTIONS,
    OllamaRequest,
    parse_chat,
    parse_embed,
    parse_generate,
)
from hal0d.ollama.stream import Clocks, MalformedChunk, Translator, timestamp
from hal0d.ollama.transform import OllamaTransform

log = get_logger()
T = TypeVar("T")

# The Ollama release whose API (api/types.go) this surface speaks.
OLLAMA_VERSION: Final = "0.32.15"
NDJSON_HEADERS: Final = {hdrs.CONTENT_TYPE: "application/x-ndjson",
                         hdrs.CACHE_CONTROL: "no-cache", "X-Accel-Buffering": "no"}
# The models are hal0d's configuration's: known since it started.
STARTED: Final = time.time()
UNMANAGED: Final = ("pull", "push", "create", "copy", "delete")
# Options named once in the log each (a client sends the same few with every request).
_options_logged: set[str] = set()
_MAX_OPTIONS_LOGGED: Final = 256


async def running(_: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(_: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


def served(request: web.Request) -> list[shapes.Served]:
    """Every model the request's key may use, with its slot (a route's model: its first)."""
    key = request.get(KEY)
    thinkers = request.app[OLLAMA_THINKERS]
    config = request.app[RUNTIME].current.config
    own = [shapes.Served(model, slot.name, slot.memory_mib, model in thinkers)
           for slot in config.slots for model in slot.models]
    routed = [shapes.Served(route.model, route.slots[0], None, route.model in thinkers)
              for route in config.routes]
    return [entry for entry in own + routed if key is None or key.may_use(entry.model)]


async def tags(request: web.Request) -> web.Response:
    return web.json_response(shapes.tags(served(request), STARTED))


async def show(request: web.Request) -> web.Response:
    body = parse_json_object(await read_body(request))
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    try:
        route = request.app[RUNTIME].current.router.resolve(model)
    except NoRoute as exc:
        raise NoRoute(f"model {model!r} not found: {exc.message}", field="model") from None
    if (key := request.get(KEY)) is not None:
        key.check_model(model, route.served_model)
    thinks = route.served_model in request.app[OLLAMA_THINKERS]
    model_shape = shapes.Served(model, route.slot.name, route.slot.memory_mib, thinks)
    return web.json_response(shapes.show(model_shape, STARTED))


async def ps(request: web.Request) -> web.Response:
    """The models of the slots that are up, with when each unloads (never, for a slot hal0d
    does not unload)."""
    table, lifecycle = request.app[SLOTS], request.app[LIFECYCLE]
    loaded: list[tuple[shapes.Served, float | None]] = []
    for model in served(request):
        slot = table.get(model.slot)
        if slot is not None and slot.state in (SlotState.READY, SlotState.SERVING):
            loaded.append((model, lifecycle.unloads_in(slot.name)))
    return web.json_response(shapes.ps(loaded, time.time()))


async def unmanaged(request: web.Request) -> web.Response:
    raise InvalidRequest(
        f"hal0d does not manage model files: {request.path} is not served (no pull, push, "
        "create, copy or delete); a model is served by adding it to a [[slots]] entry of "
        "hal0d's configuration, and /api/tags lists them")


async def chat(request: web.Request) -> web.StreamResponse:
    return await converse(request, parse_chat(parse_json_object(await read_body(request))),
                          chat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    return await converse(request, parse_generate(parse_json_object(await read_body(request))),
                          chat=False)


def log_ignored(options: tuple[str, ...]) -> None:
    for name in options:
        if name in _options_logged or len(_options_logged) >= _MAX_OPTIONS_LOGGED:
            continue
        _options_logged.add(name)
        why = ("set when a model loads: the slot's command decides it" if name in LOAD_OPTIONS
               else "not an option hal0d knows")
        log.info("ollama.option_ignored", option=name, reason=why)


async def serve(request: web.Request, model: str, *, stream: bool,
                attempt: Callable[[Forward], Awaitable[T]]) -> T:
    """The forward path's way to `model` (each slot of a route in turn); an unknown model is
    Ollama's 404, in its words."""
    try:
        return await request.app[DISPATCH].serve(request, model, stream=stream, attempt=attempt)
    except NoRoute as exc:
        if exc.field != "model":
            raise
        raise NoRoute(f"model {model!r} not found: {exc.message}", field="model") from None


def keep_alive(request: web.Request, fwd: Forward, seconds: float | None) -> None:
    if seconds is not None:
        request.app[LIFECYCLE].keep_alive(fwd.slot.name, seconds)


async def converse(request: web.Request, req: OllamaRequest, *,
                   chat: bool) -> web.StreamResponse:
    log_ignored(req.ignored)

    async def attempt(fwd: Forward) -> web.StreamResponse:
        async with fwd:
            keep_alive(request, fwd, req.keep_alive_s)
            if req.load_only:
                return loaded(req, chat=chat)
            return await answer(fwd, req, chat=chat)

    return await serve(request, req.model, stream=req.stream, attempt=attempt)


async def opened(fwd: Forward, path: str, payload: dict[str, Any]
                 ) -> tuple[Clocks, aiohttp.ClientResponse]:
    """The upstream opened at `path` with `payload` (an error status raised as the upstream's),
    and the clocks Ollama's durations are read from."""
    clocks = Clocks(started=fwd.info.started, opened=time.monotonic(),
                    load_s=(fwd.info.load_ms or 0.0) / 1000)
    upstream = await fwd.open(path, orjson.dumps(payload))
    if upstream.status >= 400:
        raise await upstream_status_error(fwd, upstream)
    return clocks, upstream


async def answer(fwd: Forward, req: OllamaRequest, *, chat: bool) -> web.StreamResponse:
    """The chat completion for `req` on the slot, its answer as Ollama's objects."""
    clocks, upstream = await opened(fwd, "/v1/chat/completions",
                                    req.payload(fwd.route.served_model))
    if not req.stream:
        return await whole(fwd, req, clocks, chat=chat)
    if upstream.content_type != "text/event-stream":
        raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered a streaming request with "
                              f"content-type {upstream.content_type!r}, not "
                              "text/event-stream")
    translator = Translator(req.model, clocks, chat=chat, think=req.think)
    response = web.StreamResponse(status=200, headers=NDJSON_HEADERS)
    try:
        await fwd.relay(response, OllamaTransform(translator))
    finally:
        if translator.saw_thinking:
            fwd.request.app[OLLAMA_THINKERS].add(fwd.route.served_model)
    if fwd.info.prompt_tokens is None:
        fwd.info.prompt_tokens = translator.prompt_tokens
    return response


def loaded(req: OllamaRequest, *, chat: bool) -> web.Response:
    """No prompt: the slot is loaded (the lease made it ready), or unloads with keep_alive 0."""
    answer: dict[str, Any] = {"model": req.model, "created_at": timestamp(time.time())}
    if chat:
        answer["message"] = {"role": "assistant", "content": ""}
    else:
        answer["response"] = ""
    answer["done"] = True
    answer["done_reason"] = "unload" if req.keep_alive_s == 0 else "load"
    return web.Response(body=orjson.dumps(answer) + b"\n", content_type="application/json")


async def whole(fwd: Forward, req: OllamaRequest, clocks: Clocks, *,
                chat: bool) -> web.Response:
    parsed = await read_json(fwd)
    try:
        answer = shapes.whole_answer(parsed, req.model, clocks, chat=chat, think=req.think)
    except MalformedChunk as exc:
        raise UpstreamInvalid(f"slot {fwd.slot.name!r}: {exc}") from None
    if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
        fwd.info.apply_usage(parsed["usage"])
    if shapes.reasoned(parsed):
        fwd.request.app[OLLAMA_THINKERS].add(fwd.route.served_model)
    return web.json_response(answer)


async def read_json(fwd: Forward) -> Any:
    raw = await fwd.read_whole()
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered with invalid JSON") from None


async def embed(request: web.Request) -> web.Response:
    return await embeddings_of(request, legacy=False)


async def embeddings(request: web.Request) -> web.Response:
    return await embeddings_of(request, legacy=True)


async def embeddings_of(request: web.Request, *, legacy: bool) -> web.Response:
    req = parse_embed(parse_json_object(await read_body(request)), legacy=legacy)

    async def attempt(fwd: Forward) -> web.Response:
        async with fwd:
            keep_alive(request, fwd, req.keep_alive_s)
            clocks, _ = await opened(fwd, "/v1/embeddings", req.payload(fwd.route.served_model))
            parsed = await read_json(fwd)
        try:
            answer = shapes.embed_answer(parsed, req.model, clocks, legacy=legacy)
        except MalformedChunk as exc:
            raise UpstreamInvalid(f"slot {fwd.slot.name!r}: {exc}") from None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(parsed["usage"])
        return web.json_response(answer)

    return await serve(request, req.model, stream=False, attempt=attempt)
