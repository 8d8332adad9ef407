"""What a server says about itself, as hal0d reads it for its own use (GET /props here): read
within a bound, and asked again when it failed or when the server came back, over real aiohttp
upstreams, hal0d's Ollama listener and the `ollama` client."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from ollama import AsyncClient
from structlog.testing import capture_logs

from hal0d.appkeys import SLOTS
from hal0d.lifecycle import teller
from hal0d.lifecycle.vocabulary import UP
from hal0d.transport import props as upstream_props
from hal0d.transport.upstream import OWN_ANSWER_LIMIT
from tests.harness.daemons import OllamaFactory, ServerFactory
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Upstream

# SmolLM2's llama-server: its template takes no tools and does not reason.
PROPS = json.loads((Path(__file__).parent / "fixtures" / "llama-server" / "props.json")
                   .read_text())
UNKNOWN = ["completion", "tools"]  # what a server that says nothing of itself is shown with
PIECE = b"x" * 2**16


async def capabilities_of(base: str) -> list[str]:
    return list((await AsyncClient(host=base).show("chat")).capabilities or ())


async def test_a_props_answer_over_the_bound_is_refused_and_hal0d_answers_on(
        upstream_app: Upstream, start_ollama: OllamaFactory) -> None:
    async def flood(request: web.Request) -> web.StreamResponse:
        """A description that reasons, a chunk at a time, past the bound."""
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            await response.write(b'{"chat_template": "<think>')
            for _ in range(OWN_ANSWER_LIMIT // len(PIECE) + 16):
                await response.write(PIECE)
            await response.write(b'"}')
            await response.write_eof()
        return response

    upstream = await upstream_app({"GET /props": flood})
    _, base = await start_ollama(upstream, models=("chat",))
    with capture_logs() as logs:
        # Read as no answer: the description was not taken in, nothing is said to reason.
        assert await capabilities_of(base) == UNKNOWN
    refused = [entry for entry in logs if entry["event"] == "upstream.answer_too_large"]
    assert refused == [{"event": "upstream.answer_too_large", "log_level": "warning",
                        "slot": "llm", "path": "/props", "limit_bytes": OWN_ANSWER_LIMIT}], logs
    models = (await AsyncClient(host=base).list()).models
    assert [model.model for model in models] == ["chat"]


async def test_an_event_of_another_hal0ds_feed_over_the_bound_is_refused(
        upstream_app: Upstream, start_hal0d: ServerFactory) -> None:
    """The feed of a second box (a slot of kind "hal0d") is read as it comes, but an event is
    held until it ends: one that never does is refused at the bound, not held."""
    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        with contextlib.suppress(ConnectionResetError):
            await response.write(b"event: slot\ndata: ")
            for _ in range(OWN_ANSWER_LIMIT // len(PIECE) + 16):
                await response.write(PIECE)
            await asyncio.Event().wait()  # the event never ends
        return response

    upstream = await upstream_app({"GET /api/events": endless})
    with capture_logs() as logs:
        await start_hal0d(upstream, models=("chat",), slot={"kind": "hal0d"})
        refused = await eventually(
            lambda: [e for e in logs if e["event"] == "upstream.answer_too_large"], 20,
            "the feed's event refused")
    assert refused[0] == {"event": "upstream.answer_too_large", "log_level": "warning",
                          "slot": "llm", "path": "/api/events",
                          "limit_bytes": OWN_ANSWER_LIMIT}, refused


async def test_a_server_without_a_command_that_first_has_no_props_is_asked_again(
        upstream_app: Upstream, start_ollama: OllamaFactory,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answered 404 (still starting, or behind a proxy being set up) is asked
    again after a pause, and what it then says is shown without restarting hal0d."""
    monkeypatch.setattr(upstream_props, "PROPS_RETRY_FIRST_S", 0.3)
    asked = 0

    async def later(_: web.Request) -> web.Response:
        nonlocal asked
        asked += 1
        return web.json_response(PROPS) if asked > 1 else web.json_response({}, status=404)

    upstream = await upstream_app({"GET /props": later})
    _, base = await start_ollama(upstream, models=("chat",))
    assert await capabilities_of(base) == UNKNOWN

    async def described() -> bool:
        return await capabilities_of(base) == ["completion"]

    await eventually(described, 10, "its description shown")
    # Asked again once its pause had passed, not by every model list meanwhile.
    assert asked == 2


async def serve_props(port: int, props: dict[str, Any]) -> web.AppRunner:
    """A server on `port` that answers the probe and describes itself with `props`."""
    app = web.Application()

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def described(_: web.Request) -> web.Response:
        return web.json_response(props)

    app.router.add_get("/v1/models", models)
    app.router.add_get("/props", described)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_a_server_without_a_command_restarted_with_another_model_is_described_anew(
        start_ollama: OllamaFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(teller, "PROBE_INTERVAL_S", 0.1)
    port = free_port()
    first = await serve_props(port, PROPS)
    hal0d, base = await start_ollama(f"http://127.0.0.1:{port}", models=("chat",))
    slot = hal0d.app[SLOTS]["llm"]
    second = None
    try:
        await eventually(lambda: slot.state in UP, 10, "the slot up")
        assert await capabilities_of(base) == ["completion"]
        await first.cleanup()
        await eventually(lambda: slot.state not in UP, 10, "the probe saw the server gone")
        vision = {"chat_template_caps": {"supports_tool_calls": True},
                  "modalities": {"vision": True}}
        second = await serve_props(port, vision)
        await eventually(lambda: slot.state in UP, 10, "the probe saw the server back")
        assert await capabilities_of(base) == ["completion", "tools", "vision"]
    finally:
        await first.cleanup()
        if second is not None:
            await second.cleanup()
