"""What a model can do, as Ollama's clients read it from /api/show (`llm-ollama` caches it by
the model's digest, Open WebUI offers thinking, vision and embedding by it), through the official
`ollama` client: declared in the config per model, read from llama-server's /props (a capture
of the real one) where the config is silent, stable across use, and the digest changing with it;
and a model that only reasons never answers an empty message."""

from __future__ import annotations

import asyncio
import json
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from ollama import AsyncClient

from hal0d import config as configuration
from hal0d.appkeys import SLOTS
from hal0d.config import Config
from hal0d.lifecycle.slots import SlotState
from hal0d.ollama import capabilities
from tests.harness.client import HI
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, OllamaFactory
from tests.harness.poll import eventually
from tests.harness.stubs import Stub, StubFactory, Upstream

PROPS = json.loads((Path(__file__).parent / "fixtures" / "llama-server" / "props.json")
                   .read_text())
THINKING_TEXT = "The user greets me. A short friendly answer fits best here."


def config_of(stub: Stub, tmp_path: Path, capabilities: str = "") -> Config:
    """One slot over the stub, its `capabilities` line as written in TOML."""
    return configuration.parse(tomllib.loads(textwrap.dedent(f"""
        [[slots]]
        name = "llm"
        upstream = "{stub.url}"
        models = ["reasoning", "chat", "think-only"]
        {capabilities}

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """)), base_dir=tmp_path)


async def tags(base: str) -> dict[str, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(base + "/api/tags") as resp:
        return {model["name"]: model for model in (await resp.json())["models"]}


async def shown(client: AsyncClient, model: str) -> tuple[list[str], str | None]:
    """The model's capabilities and digest, as /api/show and /api/tags say them."""
    show = await client.show(model)
    listed = {m.model: m.digest for m in (await client.list()).models}
    return list(show.capabilities or ()), listed[model]


async def test_declared_capabilities_are_shown_before_any_use_and_do_not_change_with_it(
        stub: Stub, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    config = config_of(stub, tmp_path, 'capabilities = { reasoning = ["thinking", "tools"] }')
    _, base = await start_ollama(stub.url, config=config)
    client = AsyncClient(host=base)
    before = {model: await shown(client, model) for model in ("reasoning", "chat", "think-only")}
    assert before["reasoning"][0] == ["completion", "tools", "thinking"]
    # Not declared, and the stub has no /props (as vLLM): what every chat model is asked for.
    assert before["chat"][0] == before["think-only"][0] == ["completion", "tools"]
    # The models reason (think-only does nothing else); that changes nothing a client caches.
    for model in ("reasoning", "think-only"):
        answer = await client.chat(model, HI, stream=False, think=True)
        assert answer.message.thinking == THINKING_TEXT
        assert [p async for p in await client.chat(model, HI, stream=True)]
    after = {model: await shown(client, model) for model in before}
    assert after == before


async def test_the_digest_is_stable_across_runs_and_changes_with_the_capabilities(
        stub: Stub, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    digests = []
    for line in ("", "", 'capabilities = ["thinking", "vision"]'):
        _, base = await start_ollama(stub.url, config=config_of(stub, tmp_path, line))
        digests.append((await tags(base))["reasoning"]["digest"])
    first, again, declared = digests
    assert first == again  # a restart with the same config: a client's cache still holds
    assert declared != first
    client = AsyncClient(host=base)
    assert (await client.show("chat")).capabilities == ["completion", "vision", "thinking"]


async def test_an_embedding_model_says_embedding_alone_and_embeds(
        stub: Stub, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    config = config_of(stub, tmp_path, 'capabilities = { chat = ["embedding"] }')
    _, base = await start_ollama(stub.url, config=config)
    client = AsyncClient(host=base)
    assert (await client.show("chat")).capabilities == ["embedding"]
    embedded = await client.embed("chat", ["one"])
    assert len(embedded.embeddings) == 1 and embedded.embeddings[0]


async def test_undeclared_capabilities_are_what_llama_servers_props_say(
        start_stub: StubFactory, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    """SmolLM2's template takes no tools and does not reason: /props says so, and so does
    /api/show; /api/ps shows the context llama-server holds."""
    described = await start_stub(props=PROPS)
    config = config_of(described, tmp_path, 'capabilities = { reasoning = ["thinking"] }')
    _, base = await start_ollama(described.url, config=config)
    client = AsyncClient(host=base)
    assert (await client.show("chat")).capabilities == ["completion"]
    assert (await client.show("reasoning")).capabilities == ["completion", "thinking"]
    running = {m.model: m for m in (await client.ps()).models}
    async with aiohttp.ClientSession() as http, http.get(base + "/api/ps") as resp:
        raw = {m["name"]: m for m in (await resp.json())["models"]}
    assert running.keys() == raw.keys() and raw["chat"]["context_length"] == 2048
    info = (await client.show("chat")).modelinfo or {}
    assert info["hal0d.context_length"] == 2048  # a key litellm (aider) reads the window from
    for _ in range(3):
        await client.show("chat")
    asked = [line for line in described.lines() if line.endswith(" props")]
    assert len(asked) == 1  # asked once for the run of its process
    plain = await start_stub()
    _, silent = await start_ollama(plain.url, config=config_of(plain, tmp_path))
    assert (await tags(silent))["chat"]["digest"] != (await tags(base))["chat"]["digest"]


async def test_an_answer_of_reasoning_alone_is_never_an_empty_message(
        stub: Stub, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    """Without `think`, as Ollama does for a model that thinks: the reasoning is `thinking`;
    with `think: false`, the model said nothing else, so its reasoning is the content."""
    _, base = await start_ollama(stub.url, config=config_of(stub, tmp_path))
    client = AsyncClient(host=base)
    whole = await client.chat("think-only", HI, stream=False)
    assert whole.message.thinking == THINKING_TEXT
    parts = [p async for p in await client.chat("think-only", HI, stream=True)]
    assert "".join(p.message.thinking or "" for p in parts) == THINKING_TEXT
    for stream in (False, True):
        if stream:
            pieces = [p async for p in await client.chat("think-only", HI, stream=True,
                                                         think=False)]
            content = "".join(p.message.content or "" for p in pieces)
            assert not any(p.message.thinking for p in pieces)
        else:
            answer = await client.chat("think-only", HI, stream=False, think=False)
            content, thinking = answer.message.content, answer.message.thinking
            assert thinking is None
        assert content == THINKING_TEXT
    generated = await client.generate("think-only", "hi", stream=False, think=False)
    assert generated.response == THINKING_TEXT


def test_a_llama_server_command_with_embedding_and_a_template_that_reasons_say_so() -> None:
    assert capabilities.capabilities(None, ["llama-server", "-m", "e.gguf", "--embeddings"],
                                     PROPS) == ("embedding",)
    qwen = {**PROPS, "chat_template": PROPS["chat_template"] + "{{ '<think>' }}",
            "chat_template_caps": {**PROPS["chat_template_caps"], "supports_tool_calls": True},
            "modalities": {"vision": True, "audio": False}}
    assert capabilities.of_props(qwen) == ("completion", "tools", "vision", "thinking")
    # What the config declares wins over both.
    assert capabilities.capabilities(("tools",), ["llama-server", "--embedding"], qwen) == (
        "completion", "tools")


async def test_an_unloaded_on_demand_slot_says_what_its_server_said_when_it_was_up(
        tmp_path: Path, start_ollama: OllamaFactory) -> None:
    """What /props said stands for the next process of the same command: a model list read
    while the slot is unloaded does not flip its capabilities and digest with every load."""
    props = Path(__file__).parent / "fixtures" / "llama-server" / "props.json"
    slot = on_demand("a", tmp_path, "--props", str(props))
    hal0d, base = await start_ollama("http://unused", config=build_config(tmp_path, slot))
    client = AsyncClient(host=base, timeout=STARTUP_S + 10)
    assert (await shown(client, "chat"))[0] == ["completion", "tools"]  # never up: not known
    await client.chat("chat", HI, stream=False)
    loaded = await shown(client, "chat")
    assert loaded[0] == ["completion"]
    await client.chat("chat", HI, stream=False, keep_alive=0)
    await eventually(lambda: hal0d.app[SLOTS]["a"].state is SlotState.STOPPED, STARTUP_S,
                     "the slot unloaded")
    assert await shown(client, "chat") == loaded


async def test_a_server_that_never_answers_props_is_not_asked_by_every_model_list(
        upstream_app: Upstream, start_ollama: OllamaFactory) -> None:
    """Open WebUI reads /api/tags and /api/ps every few seconds: a server that gives /props no
    answer within its bound costs one wait, then is left alone until PROPS_RETRY_FIRST_S."""
    asked = 0

    async def silent(_: web.Request) -> web.StreamResponse:
        nonlocal asked
        asked += 1
        await asyncio.Event().wait()  # no answer, the connection open
        raise AssertionError("unreachable")

    upstream = await upstream_app({"GET /props": silent})
    _, base = await start_ollama(upstream, models=("chat",))
    client = AsyncClient(host=base)
    for _ in range(3):
        assert (await client.show("chat")).capabilities == ["completion", "tools"]
        assert "chat" in await tags(base)
    assert asked == 1
