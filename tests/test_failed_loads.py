"""A model that does not load evicts a working one once at most: two on-demand stub slots in a
group of `max_loaded = 1`, one of them broken (its process exits as a missing model file makes
llama-server exit), asked for in turn. After its first failure the broken one loads only into
room there is, until its config changes or an operator loads it (then it may evict again)."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.config import GroupConfig
from tests.harness.client import body, state_is
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import ServerFactory, start

GROUP = {"gpu": GroupConfig(name="gpu", max_loaded=1, policy="fifo")}


async def ask(http: aiohttp.ClientSession, hal0d: TestServer, model: str
              ) -> tuple[int, dict[str, Any]]:
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body(model)) as resp:
        return resp.status, await resp.json()


async def good_and_broken(start_hal0d: ServerFactory, tmp_path: Any) -> TestServer:
    """`a` (chat) loads; `b` (think-only) exits as llama-server does on a model it cannot read."""
    good = on_demand("a", tmp_path, group="gpu")
    broken = on_demand("b", tmp_path, "--fail-start", "error: failed to load model 'x.gguf'",
                       group="gpu")
    return await start(start_hal0d, build_config(tmp_path, good, broken, groups=GROUP))


async def test_a_broken_model_evicts_the_working_one_once_at_most(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await good_and_broken(start_hal0d, tmp_path)
    with capture_logs() as logs:
        for _ in range(3):
            status, answer = await ask(http, hal0d, "chat")
            assert status == 200, answer
            status, answer = await ask(http, hal0d, "think-only")
            assert status == 503, answer
            assert "failed to load model" in answer["error"]["message"], answer
            await asyncio.sleep(1.1)  # past the failed load's first backoff: it is tried again
    evictions = [e for e in logs if e["event"] == "slot.evicting"]
    assert [(e["slot"], e["for"]) for e in evictions] == [("a", "b")], evictions
    loads = [e["slot"] for e in logs if e["event"] == "slot.loaded"]
    assert loads == ["a", "a"], loads  # the first load, and the one after the single eviction
    refused = [e for e in logs if e["event"] == "slot.not_evicting"]
    assert refused and {(e["slot"], e["for"]) for e in refused} == {("a", "b")}
    await state_is(http, hal0d, "a", "ready")  # the working model stays loaded


async def test_an_operators_load_of_the_broken_model_may_evict_again(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await good_and_broken(start_hal0d, tmp_path)
    assert (await ask(http, hal0d, "chat"))[0] == 200
    assert (await ask(http, hal0d, "think-only"))[0] == 503  # evicts a, fails
    assert (await ask(http, hal0d, "chat"))[0] == 200  # a again
    with capture_logs() as logs:
        async with http.post(hal0d.make_url("/api/slots/b/load")) as resp:
            assert resp.status == 503, await resp.text()
    assert [e["slot"] for e in logs if e["event"] == "slot.evicting"] == ["a"]


async def test_a_missing_model_file_is_found_before_anything_is_evicted(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    """llama-server told to load a file that is not there: the load fails on that, at once,
    before the working model is unloaded to make room for it."""
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\nexit 1\n")
    server.chmod(0o755)
    good = on_demand("a", tmp_path, group="gpu")
    typo = on_demand("b", tmp_path, group="gpu")
    typo = dataclasses.replace(typo, command=(str(server), "-m", str(tmp_path / "typo.gguf")))
    hal0d = await start(start_hal0d, build_config(tmp_path, good, typo, groups=GROUP))
    assert (await ask(http, hal0d, "chat"))[0] == 200
    with capture_logs() as logs:
        status, answer = await ask(http, hal0d, "think-only")
    assert status == 503, answer
    assert "typo.gguf" in answer["error"]["message"] and "does not exist" in (
        answer["error"]["message"])
    assert [e for e in logs if e["event"] == "slot.evicting"] == []
    assert (await state_is(http, hal0d, "a", "ready"))["state"] == "ready"
