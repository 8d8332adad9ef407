"""make_app(config): routes, the request lifecycle middleware, and the cleanup contexts
(contexts.py) in the order they start.

A request is finished where it ends: the lifecycle middleware's last step writes its
`request.done` line and makes its record (Prometheus, the live metrics, the event feed, the
history writer's queue) before it returns, so the log and every reader of the metrics have a
request by the time its client has the answer (a read of the history waits for the writer's
queue). Nothing is deferred, so no reader has to flush anything first.
"""

from __future__ import annotations

import asyncio
import re
import secrets

import structlog
from aiohttp import hdrs, web

from hal0d.appkeys import (
    EVENTS,
    HEADS,
    KEY_LIMITS,
    OLLAMA_OPTIONS_LOGGED,
    RECORDER,
    RESPONSE_OWNERS,
    RUNTIME,
    SHARE_BOOK,
    SURFACES,
)
from hal0d.config import Config
from hal0d.contexts import devices_context, dispatch_context, recorder_context
from hal0d.errors import ErrorCode, Hal0Error, MethodNotAllowed, NoRoute
from hal0d.front import access
from hal0d.front.access import listener_port
from hal0d.front.heads import HeadWatch
from hal0d.front.surfaces import ANTHROPIC, HAL0D, OLLAMA, OPENAI, Handler, Surface, Surfaces
from hal0d.handlers import admin, anthropic, keys, openai, page, responses, timeline
from hal0d.handlers import ollama as ollama_handlers
from hal0d.keys import KEY, KeyLimits
from hal0d.logs import get_logger
from hal0d.observability.events import EventHub
from hal0d.observability.recorder import UNLOGGED_PATHS, done_fields, record_of
from hal0d.observability.requestinfo import INFO, RequestInfo
from hal0d.response_owners import ResponseOwners
from hal0d.routing import Runtime, RuntimeRef
from hal0d.shares.book import ShareBook

log = get_logger()
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
REQUEST_ID_HEADER = "X-Request-Id"


def translate_http_exception(exc: web.HTTPException, request: web.Request) -> Hal0Error:
    if isinstance(exc, web.HTTPMethodNotAllowed):
        return MethodNotAllowed(
            f"method {request.method} is not allowed on {request.path}; "
            f"allowed: {', '.join(sorted(exc.allowed_methods))}"
        )
    if isinstance(exc, web.HTTPNotFound):
        return NoRoute(f"no such endpoint: {request.method} {request.path}")
    error = Hal0Error(exc.text or exc.reason)
    error.status = exc.status
    return error


# The route variables whose values are an endpoint's own name (a fixed set, by the route's
# pattern); every other variable (a response id, a slot name) stays a placeholder.
ENDPOINT_VARIABLES = ("endpoint",)


def endpoint_of(request: web.Request) -> str:
    """The request's endpoint as the history and /metrics name it: its route's template
    (`/v1/responses/{id}`), never the raw path, so client-chosen paths cannot add label values
    without bound; a path no route matched is `unmatched`."""
    resource = request.match_info.route.resource
    if resource is None:
        return "unmatched"
    template = resource.canonical
    for name in ENDPOINT_VARIABLES:
        if name in request.match_info:
            template = template.replace("{" + name + "}", request.match_info[name])
    return template


class OllamaResource(web.PlainResource):
    """A path of the Ollama API: it matches only the requests that came in on the Ollama
    listener's port, so Ollama's `/` and `/api/...` live beside hal0d's own in one application
    (one lifecycle, one recorder, one upstream session) without shadowing them."""

    def __init__(self, path: str, port: int) -> None:
        super().__init__(path)
        self.port = port

    async def resolve(self, request: web.Request) -> tuple[web.UrlMappingMatchInfo | None,
                                                            set[str]]:
        if listener_port(request) != self.port:
            return None, set()
        return await super().resolve(request)


@web.middleware
async def request_lifecycle(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Names the request, renders every error in the surface's envelope, sends the answer, and
    then, the request having ended, writes its request.done line and makes its record."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    request_id = given if _REQUEST_ID.match(given) else secrets.token_hex(8)
    info = RequestInfo(request_id=request_id, endpoint=endpoint_of(request))
    request[INFO] = info
    request.app[HEADS].served(request.protocol)
    structlog.contextvars.bind_contextvars(request_id=request_id)
    surface = request.app[SURFACES].of(request)
    try:
        response = await answer(request, handler, info, surface)
        await send(request, response, info)
        return response
    except asyncio.CancelledError:
        if not info.answered:
            info.fail(ErrorCode.CLIENT_DISCONNECT)
        raise
    finally:
        structlog.contextvars.unbind_contextvars("request_id")
        info.end()
        finish(request, info, surface)


async def answer(
    request: web.Request, handler: Handler, info: RequestInfo, surface: Surface,
) -> web.StreamResponse:
    """The handler's answer, or the error it raised in its surface's envelope."""
    runtime = request.app[RUNTIME].current
    server = runtime.config.server
    try:
        access.admit(request, server, listening_host(request, runtime.config))
        if (preflight := access.preflight(request, server)) is not None:
            return preflight
        if not surface.served:
            # One of hal0d's own routes (its page, /api/slots): not on the Ollama listener.
            raise NoRoute(f"no such endpoint on the Ollama API: {request.method} {request.path}")
        scope = surface.scope(request.method, request.path, server.protect_metrics)
        key = access.check(request, runtime.keys, scope)
        if key is not None:
            request[KEY] = key
            info.key = key.name
        # A key's limits count its model calls, never the page's polls.
        counted = key if surface.is_model_call(request) else None
        with request.app[KEY_LIMITS].admitted(counted):
            response = await handler(request)
        if not info.status:
            info.status = response.status
        return response
    except Hal0Error as exc:
        info.fail(exc.error_code)
        if (started := answer_started(request, info)) is not None:
            return started
        info.status = exc.status
        return surface.error_response(exc)
    except web.HTTPException as exc:
        error = translate_http_exception(exc, request)
        info.fail(error.error_code)
        if (started := answer_started(request, info)) is not None:
            return started
        info.status = error.status
        return surface.error_response(error)
    except Exception:
        log.exception("request.failed", path=request.path)
        info.fail(ErrorCode.INTERNAL)
        if (started := answer_started(request, info)) is not None:
            return started
        info.status = 500
        return surface.error_response(Hal0Error("internal error in hal0d; see its log"))


def listening_host(request: web.Request, config: Config) -> str | None:
    """The host the Ollama listener listens on, for a request that came in on it (the Host
    check's, access.admit); None for [server]'s listener."""
    ollama = config.ollama.address
    if ollama is None or not request.app[SURFACES].on_ollama(request):
        return None
    return ollama[0]


async def send(request: web.Request, response: web.StreamResponse, info: RequestInfo) -> None:
    """A whole answer written out here rather than after the middleware (where aiohttp would
    find it sent and do nothing more): the client has it before the request's line and record
    are made. A stream was written by its handler already."""
    if response.prepared:
        return
    try:
        await response.prepare(request)
        await response.write_eof()
    except ConnectionResetError:
        info.fail(ErrorCode.CLIENT_DISCONNECT)  # aiohttp's own finish ignores the rest


def finish(request: web.Request, info: RequestInfo, surface: Surface) -> None:
    """The ended request's record (once the recorder runs) and its request.done line. A failure
    here costs this request's line or record, never its answer nor any other request's."""
    method, path = request.method, request.path
    try:
        recorder = request.app.get(RECORDER) if surface.is_model_call(request) else None
        if recorder is not None and (key := request.get(KEY)) is not None:
            recorder.charge(info, key, request.content_length)
        record = record_of(info)
        if recorder is not None:
            recorder.record(info, record)
        if path not in UNLOGGED_PATHS:
            log.info("request.done", method=method, path=path, **done_fields(record))
    except Exception:
        log.exception("request.finish_failed", request_id=info.request_id, path=path)


# The response whose head is written (on_response_prepare): an error after it (a stream's handler
# that fails) cannot be answered with an envelope (see answer_started).
PREPARED = web.RequestKey("hal0d_prepared", web.StreamResponse)


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every response's head: its request id and CORS headers."""
    request[PREPARED] = response
    info = request.get(INFO)
    if info is not None:
        response.headers[REQUEST_ID_HEADER] = info.request_id
    access.add_cors_headers(request, response, request.app[RUNTIME].current.config.server)


def answer_started(request: web.Request, info: RequestInfo) -> web.StreamResponse | None:
    """The response already begun when a handler failed, its connection cut: a client reading a
    stream sees it break (the SDKs raise) instead of waiting for a rest that never comes, and no
    second head is written into the first one's body. None when nothing was sent yet."""
    started = request.get(PREPARED)
    if started is None:
        return None
    info.status = info.status or started.status
    if request.transport is not None:
        request.transport.abort()
    return started


async def warn_if_exposed(app: web.Application) -> None:
    runtime = app[RUNTIME].current
    server = runtime.config.server
    ollama = runtime.config.ollama.address
    for host, listener in ((server.host, "server"), (ollama[0] if ollama else None, "ollama")):
        if host is not None and not access.is_loopback(host) and not runtime.keys:
            log.warning(
                "server.unprotected",
                host=host,
                listener=listener,
                hint="reachable beyond this machine with no [[keys]] or [server].api_keys: "
                     "anyone can use it",
            )


async def close_events(app: web.Application) -> None:
    """on_shutdown (before aiohttp waits for open connections): the event feeds end."""
    app[EVENTS].close()


def make_app(config: Config) -> web.Application:
    app = web.Application(
        middlewares=[request_lifecycle], client_max_size=config.server.max_body_bytes
    )
    app[RUNTIME] = RuntimeRef(Runtime.build(config))
    app[EVENTS] = EventHub()
    app[HEADS] = HeadWatch(config.server.header_timeout_s)
    app.on_shutdown.append(close_events)
    app[RESPONSE_OWNERS] = ResponseOwners()
    app[KEY_LIMITS] = KeyLimits()
    app[SHARE_BOOK] = ShareBook(config.dispatcher.share_window_s,
                                config.dispatcher.batch_max_wait_s)
    app[OLLAMA_OPTIONS_LOGGED] = set()
    ollama_address = config.ollama.address
    app[SURFACES] = Surfaces(ollama_address[1] if ollama_address is not None else None)
    app.cleanup_ctx.append(recorder_context)
    app.cleanup_ctx.append(dispatch_context)
    app.cleanup_ctx.append(devices_context)
    app.on_response_prepare.append(on_prepare)
    app.on_startup.append(warn_if_exposed)

    add_routes(app.router, app[SURFACES])
    return app


GET, POST, DELETE = hdrs.METH_GET, hdrs.METH_POST, hdrs.METH_DELETE


def add_routes(router: web.UrlDispatcher, surfaces: Surfaces) -> None:
    """Every route, each declared with its surface (front/surfaces.py); the ones under /v1/ are
    the Ollama listener's too, as Ollama serves them."""
    if surfaces.ollama_port is not None:
        # First: on its port, its `/` is Ollama's.
        add_ollama_routes(router, surfaces, surfaces.ollama_port)
    surfaces.add_routes(router, HAL0D, [(GET, "/healthz", admin.healthz),
                                        (GET, "/readyz", admin.readyz)])
    for prefix in ("/v1", "/llm/v1"):
        surfaces.add_routes(router, OPENAI, [
            (GET, f"{prefix}/models", openai.list_models),
            *((POST, f"{prefix}/{{endpoint:{re.escape(endpoint)}}}", openai.dispatch)
              for endpoint in openai.ENDPOINTS),
            (POST, f"{prefix}/responses", responses.create),
            (GET, f"{prefix}/responses/{{id}}", responses.stored),
            (DELETE, f"{prefix}/responses/{{id}}", responses.stored),
        ], on_ollama=prefix == "/v1")
    for path in ("/llm/v1/messages", "/v1/messages"):
        surfaces.add_routes(router, ANTHROPIC, [
            (POST, path, anthropic.messages),
            (POST, f"{path}/count_tokens", anthropic.count_tokens),
        ], on_ollama=path.startswith("/v1/"))
    surfaces.add_routes(router, HAL0D, [
        (GET, "/", page.index),
        (GET, "/static/{name}", page.static),
        (GET, "/api/status", admin.status),
        (GET, "/api/slots", admin.slots),
        (POST, "/api/slots/{name}/load", admin.load_slot),
        (POST, "/api/slots/{name}/unload", admin.unload_slot),
        (GET, "/api/slots/metrics", admin.slot_metrics),
        (GET, "/api/devices", admin.devices),
        (GET, "/api/library", admin.library),
        (POST, "/api/library/rescan", admin.rescan_library),
        (GET, "/api/events", admin.events),
        (GET, "/api/requests", admin.requests),
        (GET, "/api/keys", keys.keys),
        (GET, "/api/timeline", timeline.timeline),
        (GET, "/metrics", admin.prometheus),
    ])


def add_ollama_routes(router: web.UrlDispatcher, surfaces: Surfaces, port: int) -> None:
    """The Ollama API's paths, matched on the Ollama listener's port only (OllamaResource)."""
    routes: list[tuple[str, tuple[str, ...], Handler]] = [
        ("/", (hdrs.METH_GET, hdrs.METH_HEAD), ollama_handlers.running),
        ("/api/version", (hdrs.METH_GET, hdrs.METH_HEAD), ollama_handlers.version),
        ("/api/tags", (hdrs.METH_GET, hdrs.METH_HEAD), ollama_handlers.tags),
        ("/api/ps", (hdrs.METH_GET,), ollama_handlers.ps),
        ("/api/show", (hdrs.METH_POST,), ollama_handlers.show),
        ("/api/chat", (hdrs.METH_POST,), ollama_handlers.chat),
        ("/api/generate", (hdrs.METH_POST,), ollama_handlers.generate),
        ("/api/embed", (hdrs.METH_POST,), ollama_handlers.embed),
        ("/api/embeddings", (hdrs.METH_POST,), ollama_handlers.embeddings),
        ("/api/pull", (hdrs.METH_POST,), ollama_handlers.pull),
        *((f"/api/{name}", (hdrs.METH_POST, hdrs.METH_DELETE), ollama_handlers.unmanaged)
          for name in ollama_handlers.UNMANAGED),
    ]
    for path, methods, handler in routes:
        resource = OllamaResource(path, port)
        router.register_resource(resource)
        for method in methods:
            surfaces.add(resource.add_route(method, handler), OLLAMA)
