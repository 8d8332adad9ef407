"""The Ollama API on its own listener, driven by the official `ollama` Python client (and, for
one streamed chat, the `ollama` npm package) over real sockets, against the stub: what Open
WebUI, Home Assistant and the ollama libraries see when they are pointed at hal0d."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer
from ollama import AsyncClient, ResponseError
from structlog.testing import capture_logs

from hal0d.appkeys import SLOTS
from hal0d.config import KeyConfig
from hal0d.lifecycle.slots import SlotState
from tests.harness.client import HI
from tests.harness.config import build_config, make_config, on_demand
from tests.harness.daemons import STARTUP_S, OllamaFactory
from tests.harness.poll import eventually
from tests.harness.stubs import STUB_MODELS, Stub

ROOT = Path(__file__).resolve().parents[1]
NPM_DIR = ROOT / ".npm-test"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
async def history(hal0d: TestServer, key: str | None = None) -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession(headers=headers) as http, http.get(
            hal0d.make_url("/api/requests")) as resp:
        rows: list[dict[str, Any]] = (await resp.json())["requests"]
        return rows


async def test_root_and_version_say_ollama_is_running_on_its_port_and_the_page_stays_hal0ds(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    hal0d, base = await start_ollama(stub.url)
    async with aiohttp.ClientSession() as http:
        for method in ("GET", "HEAD"):
            async with http.request(method, base + "/") as resp:
                assert resp.status == 200
                if method == "GET":
                    assert await resp.text() == "Ollama is running"
        async with http.get(base + "/api/version") as resp:
            assert (await resp.json())["version"].count(".") == 2
        async with http.get(hal0d.make_url("/")) as resp:
            assert resp.content_type == "text/html"  # the status page, on hal0d's own port
        async with http.get(base + "/api/slots") as resp:  # hal0d's API is not Ollama's
            assert resp.status == 404
            assert "Ollama API" in (await resp.json())["error"]
        async with http.get(base + "/api/chat") as resp:  # Ollama's path, a wrong method
            assert resp.status == 405 and "POST" in (await resp.json())["error"]


async def test_list_show_and_ps_name_every_model_with_its_slot(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    listed = await client.list()
    assert {m.model for m in listed.models} == set(STUB_MODELS)
    async with aiohttp.ClientSession() as http, http.get(base + "/api/tags") as resp:
        raw = (await resp.json())["models"]  # the client keeps only the fields it knows
    assert {m["details"]["slot"] for m in raw} == {"llm"}
    shown = await client.show("chat")
    assert shown.capabilities is not None and "completion" in shown.capabilities
    assert shown.modelinfo is not None and shown.modelinfo["hal0d.slot"] == "llm"
    running = await client.ps()
    assert {m.model for m in running.models} == {m.model for m in listed.models}
    # An `always` slot is never unloaded by hal0d: it expires "never", as Ollama shows -1.
    assert all(m.expires_at is not None and m.expires_at.year > 2100 for m in running.models)


async def test_chat_streamed_and_whole_give_the_stubs_answer_and_its_counts(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    hal0d, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    parts = [part async for part in await client.chat("chat", HI, stream=True)]
    text = "".join(part.message.content or "" for part in parts)
    assert text == "Hello! I am the hal0d stub upstream. How can I help you today?"
    last = parts[-1]
    assert last.done and last.done_reason == "stop" and not any(p.done for p in parts[:-1])
    assert last.eval_count == 13 and last.prompt_eval_count
    assert last.total_duration and last.eval_duration and last.total_duration >= last.eval_duration
    whole = await client.chat("chat", HI, stream=False)
    assert whole.message.content == text and whole.done and whole.done_reason == "stop"
    assert whole.eval_count == 13
    rows = await history(hal0d)
    assert [(r["endpoint"], r["stream"], r["ok"]) for r in rows[:2]] == [
        ("/api/chat", False, True), ("/api/chat", True, True)]


async def test_generate_streams_the_answer_as_response_pieces(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    parts = [part async for part in await client.generate("chat", "hi", stream=True)]
    assert "".join(p.response for p in parts).startswith("Hello! I am the hal0d stub")
    assert parts[-1].done and parts[-1].done_reason == "stop"


async def test_thinking_comes_as_message_thinking_unless_think_is_false(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    """As Ollama does for a model that thinks: `think` not sent is `think: true`."""
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    parts = [p async for p in await client.chat("reasoning", HI, stream=True, think=True)]
    thinking = "".join(p.message.thinking or "" for p in parts)
    assert thinking == "The user greets me. A short friendly answer fits best here."
    assert "".join(p.message.content or "" for p in parts).startswith("Hello!")
    unsaid = [p async for p in await client.chat("reasoning", HI, stream=True)]
    assert "".join(p.message.thinking or "" for p in unsaid) == thinking
    plain = await client.chat("reasoning", HI, stream=False, think=False)
    assert plain.message.thinking is None and plain.message.content.startswith("Hello!")
    for think in (True, None):
        whole = await client.chat("reasoning", HI, stream=False, think=think)
        assert whole.message.thinking == thinking


async def test_tool_calls_come_with_arguments_as_an_object_streamed_and_whole(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    parts = [p async for p in await client.chat("tool", HI, tools=TOOLS, stream=True)]
    calls = [call for p in parts for call in p.message.tool_calls or ()]
    assert len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"query": "weather in Paris"}
    whole = await client.chat("tool", HI, tools=TOOLS, stream=False)
    assert whole.message.tool_calls is not None
    assert dict(whole.message.tool_calls[0].function.arguments) == {"query": "weather in Paris"}
    # The round trip: the call and its result go back, and the model answers.
    history_ = [*HI, whole.message.model_dump(exclude_none=True),
                {"role": "tool", "tool_name": "get_weather", "content": "sunny"}]
    again = await client.chat("chat", history_, tools=TOOLS, stream=False)
    assert again.message.content.startswith("Hello!")


async def test_embed_and_the_older_embeddings_give_vectors(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    embedded = await client.embed("chat", ["one", "two"])
    assert len(embedded.embeddings) == 2 and len(embedded.embeddings[0]) == 8
    assert embedded.embeddings[0] != embedded.embeddings[1]
    older = await client.embeddings("chat", "one")
    assert list(older.embedding) == list(embedded.embeddings[0])


async def test_an_unknown_model_is_a_404_naming_it_and_pull_is_refused_at_once(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    with pytest.raises(ResponseError) as unknown:
        await client.chat("llama3.2", HI, stream=False)
    assert unknown.value.status_code == 404 and "llama3.2" in unknown.value.error
    with pytest.raises(ResponseError) as streamed:
        async for _ in await client.chat("llama3.2", HI, stream=True):
            pass
    assert streamed.value.status_code == 404
    with pytest.raises(ResponseError) as shown:
        await client.show("llama3.2")
    assert shown.value.status_code == 404
    started = time.monotonic()
    with pytest.raises(ResponseError) as refused:
        await client.pull("llama3.2")
    assert refused.value.status_code == 400
    assert "does not manage model files" in refused.value.error
    with pytest.raises(ResponseError) as streamed_pull:
        async for _ in await client.pull("llama3.2", stream=True):
            pass
    assert "does not manage model files" in streamed_pull.value.error
    with pytest.raises(ResponseError) as deleted:
        await client.delete("chat")
    assert "does not manage model files" in deleted.value.error
    assert time.monotonic() - started < 5.0  # at once: nothing is downloaded or waited for


async def test_a_pull_of_a_served_model_succeeds_at_once_with_nothing_to_download(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    """Home Assistant's setup pulls the model it was given when /api/tags lacks that name
    (`chat:latest` against hal0d's `chat`); a refusal there would end its setup."""
    _, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    for name in ("chat", "chat:latest"):
        assert (await client.pull(name)).status == "success"
        statuses = [part.status async for part in await client.pull(name, stream=True)]
        assert statuses[-1] == "success"
    with pytest.raises(ResponseError) as unknown:
        await client.pull("llama3.2:latest")
    assert "does not manage model files" in unknown.value.error


async def test_a_stall_ends_the_stream_within_its_bound_with_done_reason_length(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    hal0d, base = await start_ollama(stub.url, slot={"stream_idle_timeout_s": 0.5})
    client = AsyncClient(host=base)
    started = time.monotonic()
    parts = [p async for p in await client.chat("stall", HI, stream=True)]
    assert time.monotonic() - started < 10.0
    last = parts[-1]
    assert last.done and last.done_reason == "length"
    assert "stall guard" in (last.message.content or "")
    # The cause, for a client that looks: x_hal0_stall on the last line.
    async with aiohttp.ClientSession() as http, http.post(
            base + "/api/chat", json={"model": "stall", "messages": HI}) as resp:
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert lines[-1]["x_hal0_stall"]["reason"] == "idle" and lines[-1]["done"] is True
    rows = await history(hal0d)
    assert rows[0]["error_code"] == "stream_stall_idle"


async def test_an_upstream_break_mid_stream_raises_in_the_client(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    hal0d, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    seen: list[str] = []
    with pytest.raises(ResponseError) as broke:
        async for part in await client.chat("broken", HI, stream=True):
            seen.append(part.message.content or "")
    assert "broke the stream" in broke.value.error
    # Before the error line, the answer says so in words: a client that drops that last line
    # (Open WebUI) shows a cut answer, not one that looks whole.
    answer, notice = "".join(seen[:-1]), seen[-1]
    assert answer.startswith("Hello!")
    assert notice == f"\n\n[hal0] the answer was cut off: {broke.value.error}"
    assert (await history(hal0d))[0]["error_code"] == "upstream_broken"


async def test_a_client_that_leaves_cancels_the_upstream(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    hal0d, base = await start_ollama(stub.url)
    client = AsyncClient(host=base)
    stream = await client.chat("chatty", HI, stream=True)
    for _ in range(3):
        await anext(stream)
    await stream.aclose()
    await eventually(lambda: any("cancelled" in line and "endpoint=chat" in line
                                 for line in stub.lines()), 5.0, "the stub's generation ended")
    row = await eventually(lambda: _first(hal0d), 5.0, "the chat's row in the history")
    assert row["error_code"] == "client_disconnect"


async def _first(hal0d: TestServer) -> dict[str, Any] | None:
    rows = await history(hal0d)
    return rows[0] if rows else None


async def test_keep_alive_0_unloads_an_on_demand_slot_once_answered_and_10m_shows_in_ps(
        tmp_path: Path, start_ollama: OllamaFactory) -> None:
    slot = on_demand("a", tmp_path)  # idle_unload_s 0: without keep_alive it stays loaded
    hal0d, base = await start_ollama("http://unused", config=build_config(tmp_path, slot))
    table = hal0d.app[SLOTS]
    client = AsyncClient(host=base, timeout=STARTUP_S + 10)
    answer = await client.chat("chat", HI, stream=False, keep_alive="10m")
    assert answer.message.content.startswith("Hello!")
    running = (await client.ps()).models
    assert [m.model for m in running] == ["chat"]
    assert running[0].expires_at is not None
    left_s = (running[0].expires_at - datetime.now(UTC)).total_seconds()
    assert 9 * 60 < left_s <= 10 * 60 + 1
    answer = await client.chat("chat", HI, stream=False, keep_alive=0)
    assert answer.message.content.startswith("Hello!")
    await eventually(lambda: table["a"].state is SlotState.STOPPED, STARTUP_S,
                     "the slot unloaded after the answer")
    assert (await client.ps()).models == []


async def test_ollama_stop_loads_nothing_and_unloads_a_loaded_model(
        tmp_path: Path, start_ollama: OllamaFactory) -> None:
    """`ollama stop` is a generate with no prompt and keep_alive 0: for a model that is not
    loaded, Ollama's answer (done, done_reason unload) without starting anything; for one that
    is, the unload."""
    slot = on_demand("a", tmp_path)
    hal0d, base = await start_ollama("http://unused", config=build_config(tmp_path, slot))
    table = hal0d.app[SLOTS]
    client = AsyncClient(host=base, timeout=STARTUP_S + 10)
    stopped = await client.generate("chat", keep_alive=0)
    assert (stopped.done, stopped.done_reason) == (True, "unload")
    assert table["a"].state is SlotState.STOPPED and not (tmp_path / "a.log").exists()
    await client.generate("chat", keep_alive="10m")  # no prompt: loads it
    assert table["a"].state is SlotState.READY
    stopped = await client.generate("chat", keep_alive=0)
    assert (stopped.done, stopped.done_reason) == (True, "unload")
    await eventually(lambda: table["a"].state is SlotState.STOPPED, STARTUP_S,
                     "the loaded model unloaded")


async def test_with_keys_set_an_ollama_client_sends_its_key_as_a_bearer_token(
        stub: Stub, start_ollama: OllamaFactory, tmp_path: Path) -> None:
    config = dataclasses.replace(make_config(stub.url, tmp_path=tmp_path), keys=(
        KeyConfig(name="webui", scopes=("inference", "read"), key="s3cret",
                  secret="s3cret"),))
    hal0d, base = await start_ollama(stub.url, config=config)
    with pytest.raises(ResponseError) as refused:
        await AsyncClient(host=base).chat("chat", HI, stream=False)
    assert refused.value.status_code == 401
    keyed = AsyncClient(host=base, headers={"Authorization": "Bearer s3cret"})
    assert (await keyed.chat("chat", HI, stream=False)).message.content.startswith("Hello!")
    async with aiohttp.ClientSession() as http, http.get(base + "/") as resp:
        assert resp.status == 200  # "is a server there" needs no key
    assert (await history(hal0d, "s3cret"))[0]["key"] == "webui"


def npm_package() -> Path:
    """The ollama npm package in .npm-test (make test installs it; installed here if not)."""
    package = NPM_DIR / "node_modules" / "ollama"
    if not package.exists():
        npm = shutil.which("npm")
        assert npm is not None
        os.makedirs(NPM_DIR, exist_ok=True)
        subprocess.run([npm, "install", "--silent", "--no-audit", "--no-fund", "--prefix",
                        str(NPM_DIR), "ollama@^0.6"], check=True, timeout=300)
    return package


NODE_CHAT = """
import { Ollama } from 'ollama';
const ollama = new Ollama({ host: process.env.OLLAMA_HOST });
let text = '', last = null;
for await (const part of await ollama.chat({ model: 'chat', stream: true,
                                              messages: [{ role: 'user', content: 'hi' }] })) {
  text += part.message.content; last = part;
}
console.log(JSON.stringify({ text, done: last.done, done_reason: last.done_reason }));
"""


@pytest.mark.skipif(shutil.which("npm") is None or shutil.which("node") is None,
                    reason="npm (and node) are not installed: the ollama npm package cannot "
                           "be run (apt-get install npm)")
async def test_the_ollama_npm_package_streams_a_chat(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    npm_package()
    _, base = await start_ollama(stub.url)
    node = await asyncio.create_subprocess_exec(
        "node", "--input-type=module", "-e", NODE_CHAT, cwd=NPM_DIR,
        env={**os.environ, "OLLAMA_HOST": base},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(node.communicate(), 60)
    assert node.returncode == 0, err.decode()
    result = orjson.loads(out)
    assert result == {"text": "Hello! I am the hal0d stub upstream. How can I help you today?",
                      "done": True, "done_reason": "stop"}


async def test_an_ignored_option_is_one_log_line_per_client_saying_what_to_do_for_num_ctx(
        stub: Stub, start_ollama: OllamaFactory) -> None:
    """aider sends num_ctx with every request: one line for it, and one for another client,
    each with the value asked for; for num_ctx, that the context is the slot's (-c). What was
    said is its app's to remember: a second hal0d says it again for the same clients."""
    clients = ["litellm/1.63.0", "open-webui/0.6.5"]
    body = {"model": "chat", "messages": HI, "stream": False,
            "options": {"num_ctx": 9019, "made_up": 1}}
    said = sorted((client, option, value) for client in clients
                  for option, value in (("num_ctx", 9019), ("made_up", 1)))
    for _ in range(2):
        _, base = await start_ollama(stub.url)
        with capture_logs() as logs:
            async with aiohttp.ClientSession() as http:
                for client in clients * 2:
                    async with http.post(base + "/api/chat", json=body,
                                         headers={"User-Agent": client}) as resp:
                        assert resp.status == 200
        ignored = [e for e in logs if e["event"] == "ollama.option_ignored"]
        assert sorted((e["client"], e["option"], e["value"]) for e in ignored) == said
        [num_ctx] = [e for e in ignored if e["option"] == "num_ctx" and e["client"] == clients[0]]
        assert "-c in the slot's command" in num_ctx["reason"], num_ctx
