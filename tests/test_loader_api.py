"""On-demand slots loaded and unloaded through the admin API over real sockets and real child
processes (the stub, started as the slot's command): a load and an unload asked for, an unload
that drains a stream, refuses with requests queued and ends them when forced, and an `always`
slot that cannot be unloaded."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp

from hal0d.config import SlotConfig
from tests.harness.client import CHAT, body, chat, state_is, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, start
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import alive


async def test_load_and_unload_through_the_api(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(tmp_path, on_demand("a", tmp_path)))
    async with http.post(hal0d.make_url("/api/slots/a/load")) as resp:
        assert resp.status == 200
        assert (await resp.json())["state"] == "ready"
    pid = (await views(http, hal0d))["a"]["pid"]
    async with http.post(hal0d.make_url("/api/slots/a/unload")) as resp:
        assert resp.status == 200
        assert (await resp.json())["state"] == "stopped"
    assert not alive(pid)  # stopped means the process is gone
    async with http.post(hal0d.make_url("/api/slots/a/load?wait=false")) as resp:
        assert resp.status == 202
    await state_is(http, hal0d, "a", "ready")
    async with http.post(hal0d.make_url("/api/slots/nope/load")) as resp:
        assert resp.status == 404
    async with http.post(hal0d.make_url("/api/slots/a/unload?force=maybe")) as resp:
        assert resp.status == 400


async def test_unload_drains_a_stream_refuses_with_requests_queued_and_force_ends_them(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, models=("reasoning",), max_concurrent=1)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    long = body("reasoning", "long", stream=True, max_tokens=100)

    # Drain: the unload waits for the stream, which ends whole.
    async with http.post(hal0d.make_url(CHAT), json=long) as resp:
        assert resp.status == 200
        unload = asyncio.create_task(http.post(hal0d.make_url("/api/slots/a/unload")))
        streamed = await resp.read()
    assert streamed.endswith(b"data: [DONE]\n\n") and b"x_hal0_stall" not in streamed
    async with await unload as done:
        assert done.status == 200 and (await done.json())["state"] == "stopped"

    # Queued: 409 naming the count; force ends the stream with its frame and fails the queued.
    async with http.post(hal0d.make_url(CHAT), json=long) as resp:
        assert resp.status == 200
        await resp.content.readany()
        queued = asyncio.create_task(chat(http, hal0d, "reasoning"))

        async def one_queued() -> bool:
            return (await views(http, hal0d))["a"]["queued"] == 1

        await eventually(one_queued, 5, "a request queued")
        async with http.post(hal0d.make_url("/api/slots/a/unload")) as refused:
            assert refused.status == 409
            assert "1 requests queued" in (await refused.json())["error"]["message"]
        async with http.post(hal0d.make_url("/api/slots/a/unload?force=true")) as forced:
            assert forced.status == 200
        cut = await resp.read()
    assert b'"reason":"unloaded"' in cut and cut.endswith(b"data: [DONE]\n\n")
    # The notice names the slot and says it was unloaded: no stall, no placeholder.
    assert b"slot 'a' was unloaded by force (POST /api/slots/a/unload?force=true)" in cut, cut
    assert b"stall guard" not in cut and b"NAME" not in cut
    status, answer = await queued
    assert status == 503 and "unloaded" in answer["error"]["message"]
    view = (await views(http, hal0d))["a"]
    assert (view["state"], view["in_flight"], view["queued"]) == ("stopped", 0, 0)


async def test_a_forced_unload_ends_an_anthropic_stream_with_an_error_event(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, models=("reasoning",))
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    request = {"model": "reasoning", "max_tokens": 400, "stream": True,
               "messages": [{"role": "user", "content": "long"}]}
    async with http.post(hal0d.make_url("/llm/v1/messages"), json=request) as resp:
        assert resp.status == 200
        await resp.content.readany()
        async with http.post(hal0d.make_url("/api/slots/a/unload?force=true")) as forced:
            assert forced.status == 200
        raw = await resp.read()
    assert b"event: error" in raw and b"unloaded" in raw
    assert b"event: message_stop" not in raw


async def test_an_always_slot_cannot_be_unloaded_through_the_api(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    plain = SlotConfig(name="p", upstream=f"http://127.0.0.1:{free_port()}", models=("p",))
    hal0d = await start(start_hal0d, build_config(tmp_path, plain))
    async with http.post(hal0d.make_url("/api/slots/p/unload")) as resp:
        assert resp.status == 409
        assert "not start = 'on_demand'" in (await resp.json())["error"]["message"]
