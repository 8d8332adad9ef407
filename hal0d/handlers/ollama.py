"""The Ollama API, on its own listener ([ollama] listen): /, /api/version, /api/tags, /api/show,
/api/ps, /api/chat, /api/generate, /api/embed, /api/embeddings; push, create, copy and delete
are refused (hal0d serves its slots' models, it does not manage model files), and so is a pull,
but of a model hal0d serves, which has nothing to download. The model lists (tags, show, ps)
are read by forward/ollama_models.py, from the dispatch.

Chat and generate are translated to chat completions (hal0d/ollama/request.py) and sent through
the forward path like any other request; a stream comes back through the relay's Ollama
transform as NDJSON. Before the first line every failure is a real HTTP status with Ollama's
`{"error": ...}` body (the lifecycle middleware renders it); after it, one `{"error": ...}`
line ends the stream. `keep_alive` is told to the lifecycle manager under the lease: it sets
this load's idle timer of an on-demand slot.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, Final

import orjson
from aiohttp import hdrs, web

from hal0d import conversations
from hal0d.appkeys import DISPATCH, LIFECYCLE, OLLAMA_MODELS, OLLAMA_OPTIONS_LOGGED, RUNTIME
from hal0d.errors import Forbidden, Hal0Error, InvalidRequest, NoRoute, UpstreamInvalid
from hal0d.forward import Answer, Attempt, Call, Exchange
from hal0d.forward.context_guard import TEMPLATE_ALLOWANCE, ContextNeed
from hal0d.forward.exchange import upstream_refusal
from hal0d.handlers.body import parse_json_object, read_body
from hal0d.keys import KEY
from hal0d.lifecycle.manager import LifecycleManager
from hal0d.logs import get_logger
from hal0d.ollama import response as shapes
from hal0d.ollama.request import (
    LOAD_OPTIONS,
    EmbedRequest,
    OllamaRequest,
    parse_chat,
    parse_embed,
    parse_generate,
)
from hal0d.ollama.stream import (
    Clocks,
    MalformedChunk,
    Translator,
    encode,
    error_object,
    timestamp,
)
from hal0d.ollama.transform import OllamaTransform
from hal0d.ollama.truncate import drop_oldest_messages
from hal0d.protocol.transform import Transform
from hal0d.routing import Plan
from hal0d.transport.upstream import NDJSON_HEADERS

log = get_logger()

# The Ollama release whose API (api/types.go) this surface speaks.
OLLAMA_VERSION: Final = "0.32.15"
UNMANAGED: Final = ("push", "create", "copy", "delete")
# (client, option) pairs are named once in the log each (the app's OLLAMA_OPTIONS_LOGGED: a
# client sends the same few with every request); the client is its key's name, else its
# User-Agent, cut at _CLIENT_CHARS.
_CLIENT_CHARS: Final = 80
_MAX_OPTIONS_LOGGED: Final = 256


async def running(_: web.Request) -> web.Response:
    return web.Response(text="Ollama is running")


async def version(_: web.Request) -> web.Response:
    return web.json_response({"version": OLLAMA_VERSION})


async def tags(request: web.Request) -> web.Response:
    return web.json_response(await request.app[OLLAMA_MODELS].tags(request.get(KEY)))


def requested(request: web.Request, body: dict[str, Any]) -> tuple[str, Plan]:
    """The model a body names (`model`, or the API's older `name`) and its plan, which the
    request's key may use (NoRoute, Ollama's 404 in its words, for a name hal0d does not
    serve; Forbidden for the key)."""
    model = body.get("model") or body.get("name")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("model is required", field="model")
    key = request.get(KEY)
    try:
        plan = request.app[RUNTIME].current.router.plan(model, key)
    except NoRoute as exc:
        raise NoRoute(f"model {model!r} not found: {exc.message}", field="model") from None
    if key is not None:
        key.check_model(model, plan.model)
    return model, plan


async def show(request: web.Request) -> web.Response:
    model, plan = requested(request, parse_json_object(await read_body(request)))
    return web.json_response(await request.app[OLLAMA_MODELS].show(plan, model))


async def ps(request: web.Request) -> web.Response:
    """The models that are loaded, with when each unloads (forward/ollama_models.py)."""
    return web.json_response(await request.app[OLLAMA_MODELS].ps(request.get(KEY)))


async def pull(request: web.Request) -> web.Response:
    """A pull of a model hal0d serves (as /api/show names it: `x:latest` is `x`) has nothing to
    download: Ollama's answer for a model it has, at once. Apps pull before they use a model
    their own list of names lacks (Home Assistant's setup does, for `x:latest`), and would stop
    there. Any other name is refused as the other model-file calls are."""
    body = parse_json_object(await read_body(request))
    try:
        requested(request, body)
    except NoRoute:
        return await unmanaged(request)
    done = [{"status": "pulling manifest"}, {"status": "success"}]
    if body.get("stream", True) is False:
        return web.json_response(done[-1])
    return web.Response(body=encode(done), headers=NDJSON_HEADERS)


async def unmanaged(request: web.Request) -> web.Response:
    raise InvalidRequest(
        f"hal0d does not manage model files: {request.path} is not served (no pull, push, "
        "create, copy or delete); a model is served by adding it to a [[slots]] entry of "
        "hal0d's configuration, and /api/tags lists them")


async def chat(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    return await converse(request, parse_chat(parse_json_object(raw)), chat=True,
                          raw_size=len(raw))


async def generate(request: web.Request) -> web.StreamResponse:
    raw = await read_body(request)
    return await converse(request, parse_generate(parse_json_object(raw)), chat=False,
                          raw_size=len(raw))


def log_ignored(request: web.Request, req: OllamaRequest) -> None:
    """One line per client and option hal0d does not pass on (a client sends the same few with
    every request); `num_ctx` says what to do instead: the context is the slot's own."""
    key = request.get(KEY)
    client = (key.name if key is not None and not key.anonymous else
              request.headers.get(hdrs.USER_AGENT, "")[:_CLIENT_CHARS] or "unknown")
    logged = request.app[OLLAMA_OPTIONS_LOGGED]
    for name, value in req.ignored:
        if (client, name) in logged or len(logged) >= _MAX_OPTIONS_LOGGED:
            continue
        logged.add((client, name))
        if name == "num_ctx":
            why = ("the context is the slot's, set when its model loads (llama-server: -c in "
                   "the slot's command); hal0d cannot change it per request: make the slot's "
                   "at least this big")
        elif name in LOAD_OPTIONS:
            why = "set when a model loads: the slot's command decides it"
        else:
            why = "not an option hal0d knows"
        log.info("ollama.option_ignored", option=name, value=value, model=req.model,
                 client=client, reason=why)


async def serve(request: web.Request, model: str, exchange: Exchange,
                conversation: str | None = None) -> web.StreamResponse:
    """The forward path's way to `model` (each slot of a route in turn); an unknown model is
    Ollama's 404, in its words."""
    try:
        return await request.app[DISPATCH].serve(request, model, exchange,
                                                 conversation=conversation)
    except NoRoute as exc:
        if exc.field != "model":
            raise
        raise NoRoute(f"model {model!r} not found: {exc.message}", field="model") from None


class OllamaExchange(Exchange):
    """What Ollama's model calls share: `keep_alive` told to the lifecycle manager under the
    lease (it sets this load's idle timer of an on-demand slot), the upstream's error status in
    Ollama's `{"error": ...}`, and the clocks Ollama's durations are read from."""

    translated = True
    surface = "ollama"

    def head(self) -> Mapping[str, str]:
        return NDJSON_HEADERS

    def failed(self, error: Hal0Error) -> bytes:
        """Ollama's `{"error": ...}` line, on which its clients raise."""
        return encode([error_object(error.message)])

    def __init__(self, req: OllamaRequest | EmbedRequest, lifecycle: LifecycleManager) -> None:
        self.lifecycle = lifecycle
        self.keep_alive_s = req.keep_alive_s
        self.clocks: Clocks | None = None

    def under_lease(self, fwd: Attempt) -> None:
        if self.keep_alive_s is not None:
            self.lifecycle.keep_alive(fwd.slot.name, self.keep_alive_s)
        self.clocks = Clocks(started=fwd.info.started, opened=time.monotonic(),
                             load_s=(fwd.info.load_ms or 0.0) / 1000)

    def refused(self, answer: Answer, data: bytes) -> Hal0Error:
        return upstream_refusal(answer, data)

    def parsed(self, fwd: Attempt, data: bytes) -> Any:
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            raise UpstreamInvalid(f"slot {fwd.slot.name!r} answered with invalid JSON") from None


class Converse(OllamaExchange):
    """/api/chat and /api/generate as a chat completion, the answer as Ollama's objects."""

    def __init__(self, req: OllamaRequest, lifecycle: LifecycleManager, *, chat: bool,
                 raw_size: int = 0, truncate: bool = True) -> None:
        super().__init__(req, lifecycle)
        self.req, self.chat, self.stream = req, chat, req.stream
        self.raw_size, self.truncate = raw_size, truncate
        self.dropped = 0  # the oldest messages left out for the context (drop_oldest)

    def need(self) -> ContextNeed | None:
        """The conversation and num_predict, measured against the slot's context: one that does
        not fit loses its oldest messages, as Ollama's does (`[ollama] truncate`), but said."""
        if self.req.load_only:
            return None
        chat = lambda: self.req.payload("")  # noqa: E731 - read again after each cut
        return ContextNeed(self.raw_size + TEMPLATE_ALLOWANCE, self.req.options.get("max_tokens"),
                           chat, drop_oldest=self.drop_oldest if self.truncate else None)

    def drop_oldest(self, shed: int, counted: int) -> bool:
        """About `shed` tokens' worth of the oldest messages dropped (each weighed by its share
        of the text): the system prompts and the newest message stay, and a tool's answer goes
        with the call it answers. False when nothing may go."""
        kept, dropped = drop_oldest_messages(self.req.messages, shed, counted)
        if not dropped:
            return False
        self.req.messages, self.dropped = kept, self.dropped + dropped
        return True

    def _quiet(self) -> Translator:
        """A translator for what is said outside the answer (no clocks: no counts)."""
        return Translator(self.req.model, Clocks(0.0, 0.0, 0.0), chat=self.chat,
                          think=self.req.think)

    def keepalive(self, what: str) -> bytes:
        """An object with empty content, not done: Ollama's clients take it as a piece of the
        answer that says nothing."""
        return encode([self._quiet().keepalive()])

    def failed(self, error: Hal0Error) -> bytes:
        """The failure in words as the answer's content, then Ollama's `{"error": ...}` line:
        a client that drops that last line (Open WebUI) still shows why there is no answer."""
        return encode([self._quiet().notice(error.message), error_object(error.message)])

    def unleased(self, fwd: Attempt) -> web.StreamResponse | None:
        """`ollama stop` (no prompt, keep_alive 0) loads nothing: a loaded model unloads once
        idle, and one that is not loaded stays so, as Ollama answers it."""
        if not (self.req.load_only and self.keep_alive_s == 0):
            return None
        if fwd.warm:
            self.lifecycle.keep_alive(fwd.slot.name, 0)
        return loaded(self.req, chat=self.chat)

    async def call(self, fwd: Attempt) -> Call | web.StreamResponse:
        self.under_lease(fwd)
        if self.req.load_only:
            return loaded(self.req, chat=self.chat)
        if self.dropped:
            fwd.info.dropped_messages = self.dropped
            log.info("ollama.truncated", slot=fwd.slot.name, dropped_messages=self.dropped,
                     kept_messages=len(self.req.messages), prompt_tokens=fwd.info.prompt_tokens,
                     context=fwd.info.context_tokens)
        return Call("/v1/chat/completions",
                    orjson.dumps(self.req.payload(fwd.route.served_model)))

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        assert self.clocks is not None
        parsed = self.parsed(fwd, data)
        try:
            whole = shapes.whole_answer(parsed, self.req.model, self.clocks, chat=self.chat,
                                        think=self.req.think)
        except MalformedChunk as exc:
            raise UpstreamInvalid(f"slot {fwd.slot.name!r}: {exc}") from None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(parsed["usage"])
        return web.json_response(whole)

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        assert self.clocks is not None
        translator = Translator(self.req.model, self.clocks, chat=self.chat,
                                think=self.req.think)
        return NDJSON_HEADERS, OllamaTransform(translator)

    def relayed(self, fwd: Attempt, transform: Transform) -> None:
        assert isinstance(transform, OllamaTransform)
        if fwd.info.prompt_tokens is None:
            fwd.info.prompt_tokens = transform.translator.prompt_tokens


def client_keep_alive(request: web.Request, model: str, keep_alive_s: float | None, *,
                      unload_only: bool = False) -> float | None:
    """The client's keep_alive when it may set one. A request without a key (its listener's
    anonymous access) may use its models, not decide how long they stay loaded: its keep_alive
    is left out, and an unload alone (`ollama stop`) is refused, since hal0d's own unload takes
    a key with the admin scope."""
    key = request.get(KEY)
    if keep_alive_s is None or key is None or not key.anonymous:
        return keep_alive_s
    if unload_only and keep_alive_s == 0:
        raise Forbidden(f"a request without a key may not unload {model!r}: unloading takes a "
                        "key with the admin scope")
    log.debug("ollama.keep_alive_ignored", model=model, keep_alive_s=keep_alive_s,
              reason="a request without a key does not set how long a model stays loaded")
    return None


async def converse(request: web.Request, req: OllamaRequest, *,
                   chat: bool, raw_size: int = 0) -> web.StreamResponse:
    log_ignored(request, req)
    req.keep_alive_s = client_keep_alive(request, req.model, req.keep_alive_s,
                                         unload_only=req.load_only)
    exchange = Converse(req, request.app[LIFECYCLE], chat=chat, raw_size=raw_size,
                        truncate=request.app[RUNTIME].current.config.ollama.truncate)
    conversation = conversations.of_chat(
        request.headers, {"model": req.model, "messages": req.messages, "tools": req.tools})
    return await serve(request, req.model, exchange, conversation)


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


class Embed(OllamaExchange):
    """/api/embed and /api/embeddings as an OpenAI embeddings request."""

    def __init__(self, req: EmbedRequest, lifecycle: LifecycleManager, *, legacy: bool) -> None:
        super().__init__(req, lifecycle)
        self.req, self.legacy = req, legacy

    async def call(self, fwd: Attempt) -> Call:
        self.under_lease(fwd)
        return Call("/v1/embeddings", orjson.dumps(self.req.payload(fwd.route.served_model)))

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        assert self.clocks is not None
        parsed = self.parsed(fwd, data)
        try:
            whole = shapes.embed_answer(parsed, self.req.model, self.clocks, legacy=self.legacy)
        except MalformedChunk as exc:
            raise UpstreamInvalid(f"slot {fwd.slot.name!r}: {exc}") from None
        if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
            fwd.info.apply_usage(parsed["usage"])
        return web.json_response(whole)


async def embed(request: web.Request) -> web.StreamResponse:
    return await embeddings_of(request, legacy=False)


async def embeddings(request: web.Request) -> web.StreamResponse:
    return await embeddings_of(request, legacy=True)


async def embeddings_of(request: web.Request, *, legacy: bool) -> web.StreamResponse:
    req = parse_embed(parse_json_object(await read_body(request)), legacy=legacy)
    req = dataclasses.replace(req, keep_alive_s=client_keep_alive(request, req.model,
                                                                  req.keep_alive_s))
    exchange = Embed(req, request.app[LIFECYCLE], legacy=legacy)
    return await serve(request, req.model, exchange)
