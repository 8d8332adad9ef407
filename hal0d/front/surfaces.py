"""The APIs a request is answered in (OpenAI's, Anthropic's, Ollama's, hal0d's own), each as the
lifecycle middleware needs it: how a Hal0Error renders (the surface's error envelope), which key
scope a request needs (hal0d.keys), and whether a request is a model call (counted against its
key's limits, recorded in the history and the request metrics; the model lists, the page's
polls and the probes are not).

Each route is declared with its surface as it is added (`Surfaces.add`), and the middleware asks
the request's matched route (`Surfaces.of`), so no flag rides along with a request. The Ollama
listener serves Ollama's routes and the ones declared `on_ollama` (those under /v1/, which Ollama
serves too); any other route of hal0d matched there is Ollama's 404 (`served` False). A request
no route matched (404, 405), or one whose route was added without a surface, has no surface to
ask for: its path names it, as it names each route's, and on the Ollama listener every path but
/v1/ is Ollama's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import orjson
from aiohttp import hdrs, web
from aiohttp.web_urldispatcher import AbstractResource, AbstractRoute

from hal0d.errors import Hal0Error
from hal0d.front.access import listener_port
from hal0d.keys import ollama_scope_of, scope_of

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def is_dispatch_request(method: str, path: str) -> bool:
    """Requests for a model: the ones the history and the request metrics are about (not the
    GET /v1/models a chat front end polls)."""
    listing = method == "GET" and path.endswith("/models")
    return path.startswith(("/v1/", "/llm/")) and not listing


# The Ollama API's model calls (its model lists are not, as GET /v1/models is not).
OLLAMA_MODEL_CALLS: Final = frozenset({"/api/chat", "/api/generate", "/api/embed",
                                       "/api/embeddings"})


def is_ollama_model_call(method: str, path: str) -> bool:
    return method == "POST" and path in OLLAMA_MODEL_CALLS


def never(method: str, path: str) -> bool:
    """hal0d's own API (the page, /api/*, the probes, /metrics) makes no model call."""
    return False


def ollama_scope(method: str, path: str, protect_metrics: bool) -> str | None:
    """The Ollama listener has no /metrics: its scopes do not depend on protect_metrics."""
    return ollama_scope_of(method, path)


@dataclass(frozen=True, slots=True)
class Surface:
    """An API as the middleware answers in it (see the module's docstring). `served` False: a
    route of hal0d's that the listener the request came in on does not serve (its NoRoute is
    rendered in this surface's envelope)."""

    name: str
    body: Callable[[Hal0Error], dict[str, Any]]
    scope: Callable[[str, str, bool], str | None]  # (method, path, protect_metrics)
    model_call: Callable[[str, str], bool]  # (method, path)
    served: bool = True

    def error_response(self, exc: Hal0Error) -> web.Response:
        """The error in this surface's envelope, with its status and headers."""
        return web.Response(body=orjson.dumps(self.body(exc)), status=exc.status,
                            headers=exc.headers(), content_type="application/json")

    def is_model_call(self, request: web.Request) -> bool:
        return self.model_call(request.method, request.path)


OPENAI: Final = Surface("openai", lambda exc: exc.openai_body(), scope_of, is_dispatch_request)
ANTHROPIC: Final = Surface("anthropic", lambda exc: exc.anthropic_body(), scope_of,
                           is_dispatch_request)
OLLAMA: Final = Surface("ollama", lambda exc: exc.ollama_body(), ollama_scope,
                        is_ollama_model_call)
# hal0d's own API (the page, /api/*, the probes, /metrics): its errors in OpenAI's envelope.
HAL0D: Final = Surface("hal0d", lambda exc: exc.openai_body(), scope_of, never)
# A route of hal0d's own matched on the Ollama listener: not one of its routes.
NOT_ON_OLLAMA: Final = dataclasses.replace(OLLAMA, served=False)


def is_anthropic_path(path: str) -> bool:
    return path.startswith(("/llm/v1/messages", "/v1/messages"))


def by_path(path: str, on_ollama: bool) -> Surface:
    """The surface a path names, for a request whose route declares none (see the module's
    docstring)."""
    if on_ollama and not path.startswith("/v1/"):
        return OLLAMA
    if is_anthropic_path(path):
        return ANTHROPIC
    if path.startswith(("/v1/", "/llm/")):
        return OPENAI
    return HAL0D


class Surfaces:
    """Every route's surface, declared as the route is added, and the Ollama listener's port
    (None when it is off), so a request's surface is asked of its matched route here alone."""

    def __init__(self, ollama_port: int | None) -> None:
        self.ollama_port = ollama_port
        self._of: dict[AbstractResource, Surface] = {}
        self._on_ollama: set[AbstractResource] = set()

    def add(self, route: AbstractRoute, surface: Surface, *, on_ollama: bool = False) -> None:
        """`route` answers in `surface`; `on_ollama`: the Ollama listener serves it too (its
        own routes it serves in any case)."""
        resource = route.resource
        assert resource is not None, "a route added to a router has its resource"
        self._of[resource] = surface
        if on_ollama or surface is OLLAMA:
            self._on_ollama.add(resource)

    def add_routes(self, router: web.UrlDispatcher, surface: Surface,
                   routes: list[tuple[str, str, Handler]], *, on_ollama: bool = False) -> None:
        """Each (method, path, handler) added to `router` in `surface`; a GET answers HEAD too
        (aiohttp's add_get)."""
        for method, path, handler in routes:
            added = (router.add_get(path, handler) if method == hdrs.METH_GET
                     else router.add_route(method, path, handler))
            self.add(added, surface, on_ollama=on_ollama)

    def on_ollama(self, request: web.Request) -> bool:
        """Whether the request came in on the Ollama listener."""
        return self.ollama_port is not None and listener_port(request) == self.ollama_port

    def of(self, request: web.Request) -> Surface:
        """The surface the request is answered in: its matched route's (see the module's
        docstring)."""
        on_ollama = self.on_ollama(request)
        resource = request.match_info.route.resource
        surface = self._of.get(resource) if resource is not None else None
        if surface is None:
            # No route matched (404, 405), or one added without a surface: its path's.
            return by_path(request.path, on_ollama)
        if on_ollama and resource not in self._on_ollama:
            return NOT_ON_OLLAMA
        return surface

