"""Names as Ollama's clients send them, and what ends a load a client's keep_alive set, over real
sockets with the official `ollama` Python client.

Ollama treats `x` and `x:latest` as one model, and Home Assistant's and Open WebUI's saved
configurations carry the tag: `chat:latest` reaches `chat` on the Ollama listener and on /v1,
unless a slot or an exact alias names `chat:latest` itself, and before a catch-all glob alias.
/api/tags lists the names as configured. An unload a client's keep_alive decided (0, `ollama
stop`, or its own duration) says `keep_alive`, not `idle`, in the log, the feed and the timeline.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import orjson
import pytest
from aiohttp.test_utils import TestServer
from ollama import AsyncClient, ResponseError
from structlog.testing import capture_logs

from hal0d.appkeys import SLOTS
from hal0d.config import SlotConfig
from hal0d.lifecycle.slots import SlotState
from hal0d.protocol.sse import Decoder
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, OllamaFactory
from tests.harness.poll import eventually
from tests.harness.stubs import Stub, StubFactory

HI = [{"role": "user", "content": "hi"}]


async def last_slot(hal0d: TestServer) -> str:
    async with aiohttp.ClientSession() as http, http.get(
            hal0d.make_url("/api/requests?limit=1")) as resp:
        [row] = (await resp.json())["requests"]
        assert row["ok"], row
        slot: str = row["slot"]
        return slot


async def test_name_latest_is_the_name_on_the_ollama_listener_and_on_v1(
    start_ollama: OllamaFactory, start_stub: StubFactory, stub: Stub
) -> None:
    other = await start_stub()
    hal0d, base = await start_ollama(
        stub.url, models=("chat",),
        extra_slots=(SlotConfig(name="other", upstream=other.url, models=("reasoning",)),),
        aliases={"*": "reasoning", "tool:latest": "chat"})
    client = AsyncClient(host=base)
    answer = await client.chat("chat:latest", HI, stream=False)
    assert answer.message.content.startswith("Hello!")
    assert answer.model == "chat:latest"  # the name as the client sent it, as Ollama answers
    assert await last_slot(hal0d) == "llm"  # chat's slot, not the catch-all alias's
    parts = [part async for part in await client.generate("chat:latest", "hi", stream=True)]
    assert parts[-1].done and await last_slot(hal0d) == "llm"
    shown = await client.show("chat:latest")
    assert shown.modelinfo is not None and shown.modelinfo["hal0d.slot"] == "llm"
    # The exact alias of `tool:latest` is its own name: it keeps its target.
    await client.chat("tool:latest", HI, stream=False)
    assert await last_slot(hal0d) == "llm"
    await client.chat("anything:latest", HI, stream=False)
    assert await last_slot(hal0d) == "other"  # nothing serves `anything`: the glob's
    # /api/tags lists the names as they are configured, as before.
    assert sorted(m.model for m in (await client.list()).models) == ["chat", "reasoning"]

    sdk = openai.AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="unused",
                             max_retries=0)
    made = await sdk.chat.completions.create(model="chat:latest", messages=HI)  # type: ignore[arg-type]
    assert made.choices[0].message.content and await last_slot(hal0d) == "llm"


async def test_an_unknown_name_with_latest_is_still_ollamas_404(
    start_ollama: OllamaFactory, stub: Stub
) -> None:
    _, base = await start_ollama(stub.url, models=("chat",))
    with pytest.raises(ResponseError) as missing:
        await AsyncClient(host=base).chat("nope:latest", HI, stream=False)
    assert missing.value.status_code == 404
    assert "'nope:latest' not found" in str(missing.value.error)


@contextlib.asynccontextmanager
async def feed(hal0d: TestServer) -> AsyncIterator[list[dict[str, Any]]]:
    """The event feed's `unload` events, read while the block runs (from its `hello` on)."""
    unloads: list[dict[str, Any]] = []
    hello = asyncio.Event()

    async def read(resp: aiohttp.ClientResponse) -> None:
        decoder = Decoder()
        async for chunk in resp.content.iter_any():
            for event in decoder.feed(chunk):
                if event.event == "hello":
                    hello.set()
                elif event.event == "unload":
                    unloads.append(orjson.loads(event.data))

    async with aiohttp.ClientSession() as http, http.get(hal0d.make_url("/api/events")) as resp:
        reader = asyncio.create_task(read(resp))
        try:
            await asyncio.wait_for(hello.wait(), 5)
            yield unloads
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader


async def timeline_unloads(hal0d: TestServer) -> list[str]:
    async with aiohttp.ClientSession() as http, http.get(
            hal0d.make_url("/api/timeline")) as resp:
        events = (await resp.json())["events"]
    return [event["reason"] for event in events if event["kind"] == "unload"]


async def test_an_unload_a_clients_keep_alive_decided_says_keep_alive_and_idle_stays_idle(
    tmp_path: Path, start_ollama: OllamaFactory
) -> None:
    slot = on_demand("a", tmp_path, idle_unload_s=1)
    hal0d, base = await start_ollama("http://unused", config=build_config(tmp_path, slot))
    table = hal0d.app[SLOTS]
    client = AsyncClient(host=base, timeout=STARTUP_S + 10)

    async def stopped() -> bool:
        return table["a"].state is SlotState.STOPPED

    with capture_logs() as logs:
        async with feed(hal0d) as told:
            await client.chat("chat", HI, stream=False, keep_alive=0)
            await eventually(stopped, STARTUP_S, "unloaded by keep_alive 0")
            await client.chat("chat", HI, stream=False, keep_alive=1)  # its own 1 s
            await eventually(stopped, STARTUP_S, "unloaded by the client's 1 s")
            await client.chat("chat", HI, stream=False)  # idle_unload_s: the operator's
            await eventually(stopped, STARTUP_S, "unloaded by idle_unload_s")
            await eventually(lambda: len(told) == 3, 5, "three unload events")
    said = [line["reason"] for line in logs if line["event"] == "slot.unloaded"]
    assert said == ["keep_alive", "keep_alive", "idle"], logs
    assert [event["reason"] for event in told] == said
    assert await timeline_unloads(hal0d) == said
