"""Each request's surface is its matched route's: the envelope its errors come in, the key scope
it needs and whether it is a model call, asked of the route (front/surfaces.py) and not of a flag
the middleware carries. Table-driven over both listeners: hal0d's own routes matched on the
Ollama listener are Ollama's 404, /v1/ is served there as on hal0d's port, and a request no route
matched answers in the surface its path names."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from hal0d.app import make_app
from hal0d.appkeys import SURFACES
from hal0d.config import OllamaConfig
from hal0d.errors import NoRoute
from hal0d.front.surfaces import Surface
from hal0d.keys import INFERENCE, READ
from tests.harness.config import make_config

SERVER_PORT, OLLAMA_PORT = 8080, 11434

# (listener port, method, path) -> (surface, served, model call, scope without protect_metrics)
CASES = [
    (SERVER_PORT, "POST", "/v1/chat/completions", "openai", True, True, INFERENCE),
    (SERVER_PORT, "GET", "/v1/models", "openai", True, False, INFERENCE),
    (SERVER_PORT, "GET", "/llm/v1/responses/resp_1", "openai", True, True, INFERENCE),
    (SERVER_PORT, "POST", "/v1/messages", "anthropic", True, True, INFERENCE),
    (SERVER_PORT, "POST", "/llm/v1/messages/count_tokens", "anthropic", True, True, INFERENCE),
    (SERVER_PORT, "GET", "/v1/messages", "anthropic", True, True, INFERENCE),  # 405
    (SERVER_PORT, "POST", "/v1/no-such-endpoint", "openai", True, True, INFERENCE),  # 404
    (SERVER_PORT, "GET", "/api/slots", "hal0d", True, False, READ),
    (SERVER_PORT, "GET", "/", "hal0d", True, False, None),
    (SERVER_PORT, "GET", "/metrics", "hal0d", True, False, None),
    (SERVER_PORT, "GET", "/no-such-page", "hal0d", True, False, None),  # 404
    (OLLAMA_PORT, "POST", "/api/chat", "ollama", True, True, INFERENCE),
    (OLLAMA_PORT, "POST", "/api/embed", "ollama", True, True, INFERENCE),
    (OLLAMA_PORT, "GET", "/api/tags", "ollama", True, False, INFERENCE),
    (OLLAMA_PORT, "GET", "/", "ollama", True, False, None),
    (OLLAMA_PORT, "GET", "/api/version", "ollama", True, False, None),
    (OLLAMA_PORT, "GET", "/api/chat", "ollama", True, False, INFERENCE),  # 405
    (OLLAMA_PORT, "GET", "/api/slots", "ollama", False, False, INFERENCE),
    (OLLAMA_PORT, "GET", "/healthz", "ollama", False, False, INFERENCE),
    (OLLAMA_PORT, "POST", "/llm/v1/chat/completions", "ollama", False, False, INFERENCE),
    (OLLAMA_PORT, "POST", "/v1/chat/completions", "openai", True, True, INFERENCE),
    (OLLAMA_PORT, "POST", "/v1/messages", "anthropic", True, True, INFERENCE),
    (OLLAMA_PORT, "GET", "/v1/models", "openai", True, False, INFERENCE),
    (OLLAMA_PORT, "GET", "/api/nothing", "ollama", True, False, INFERENCE),  # 404
]


@pytest.fixture
def app(tmp_path: Path) -> web.Application:
    config = make_config("http://127.0.0.1:9", tmp_path=tmp_path)
    return make_app(dataclasses.replace(
        config, ollama=OllamaConfig(listen=f"127.0.0.1:{OLLAMA_PORT}")))


def on_port(port: int) -> mock.Mock:
    """A transport whose socket is the listener's on `port`."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda name, default=None: (
        ("127.0.0.1", port) if name == "sockname" else default)
    return transport


async def surface_of(app: web.Application, port: int, method: str, path: str) -> Surface:
    """The surface the middleware answers the request in, its route matched as aiohttp does."""
    request = make_mocked_request(method, path, app=app, transport=on_port(port))
    request._match_info = await app.router.resolve(request)  # as aiohttp's handler sets it
    return app[SURFACES].of(request)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]} {c[1]} {c[2]}" for c in CASES])
async def test_a_requests_surface_is_its_routes_on_its_listener(
        app: web.Application, case: tuple[int, str, str, str, bool, bool, str | None]) -> None:
    port, method, path, name, served, model_call, scope = case
    surface = await surface_of(app, port, method, path)
    assert (surface.name, surface.served) == (name, served)
    assert surface.model_call(method, path) is model_call
    assert surface.scope(method, path, False) == scope


async def test_each_surface_renders_an_error_in_its_own_envelope(app: web.Application) -> None:
    error = NoRoute("no such model")
    bodies = {}
    for port, path in ((SERVER_PORT, "/v1/chat/completions"), (SERVER_PORT, "/v1/messages"),
                       (OLLAMA_PORT, "/api/chat"), (SERVER_PORT, "/api/slots")):
        surface = await surface_of(app, port, "POST", path)
        response = surface.error_response(error)
        assert response.status == 404 and response.content_type == "application/json"
        assert isinstance(response.body, bytes)
        bodies[surface.name] = response.body
    assert bodies["ollama"] == b'{"error":"no such model"}'
    assert b'"type":"error"' in bodies["anthropic"]
    assert bodies["openai"] == bodies["hal0d"] and b'"code":"dispatch.no_route"' in bodies["openai"]


async def test_metrics_needs_a_key_on_hals_own_surface_only_when_protected(
        app: web.Application) -> None:
    surface = await surface_of(app, SERVER_PORT, "GET", "/metrics")
    assert surface.scope("GET", "/metrics", True) == READ
