"""Classes across a group's turns, over real sockets with the stub as each slot's command (a group
of max_loaded = 1, two models): interactive work for one model ends a batch's turn on the other
at once (its answers in flight finish first), where a busy model's priced turn holds it when
the batch is interactive too; batch work never swaps out a model while interactive work for it
is in flight."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.config import DispatcherConfig, GroupConfig, KeyConfig
from tests.harness.client import CHAT, body
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.poll import eventually

# Turns and paces counted in seconds: run with nothing beside it (setup.cfg).
pytestmark = pytest.mark.alone

SECRETS = {"chat": "sk-chat-3Nd8", "nightly": "sk-nightly-Vb6", "admin": "sk-admin-Jc1"}
LOAD_S = "0.3"  # the stub's --startup-delay


def keys(classes: bool) -> tuple[KeyConfig, ...]:
    """The chat key (interactive), the nightly key (batch when `classes`), an admin's."""
    return (KeyConfig(name="chat", scopes=("inference",), key=SECRETS["chat"],
                      secret=SECRETS["chat"]),
            KeyConfig(name="nightly", scopes=("inference",), key=SECRETS["nightly"],
                      secret=SECRETS["nightly"], service_class="batch" if classes else
                      "interactive"),
            KeyConfig(name="admin", scopes=("read", "admin"), key=SECRETS["admin"],
                      secret=SECRETS["admin"]))


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


async def two_models(start_hal0d: ServerFactory, tmp_path: Path, policy: str, *,
                     classes: bool = True) -> TestServer:
    """Slots a ("reasoning") and b ("chat") in a group of max_loaded = 1; a busy model's turn
    is 50 of its loads (15 s here) under batch."""
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1, policy=policy, min_turn_loads=50.0)}
    slots = [on_demand(name, tmp_path, "--startup-delay", LOAD_S, group="gpu0",
                       models=(model,), max_queue=64)
             for name, model in (("a", "reasoning"), ("b", "chat"))]
    config = build_config(tmp_path, *slots, groups=group, keys=keys(classes),
                          dispatcher=DispatcherConfig())
    return await start(start_hal0d, config)


async def state_of(http: aiohttp.ClientSession, hal0d: TestServer, slot: str) -> str:
    async with http.get(hal0d.make_url("/api/slots"), headers=auth("admin")) as resp:
        assert resp.status == 200
        return str(next(v for v in (await resp.json())["slots"] if v["name"] == slot)["state"])


async def answered(http: aiohttp.ClientSession, hal0d: TestServer, who: str,
                   request: dict[str, Any]) -> None:
    async with http.post(hal0d.make_url(CHAT), json=request, headers=auth(who)) as resp:
        whole = await resp.read()
        assert resp.status == 200 and whole.endswith(b"data: [DONE]\n\n"), whole[-300:]


async def test_interactive_work_ends_a_batch_turn_at_once_where_the_turn_would_hold_it(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await two_models(start_hal0d, tmp_path, "batch")
    batch_left = 30

    async def nightly() -> None:
        nonlocal batch_left
        while batch_left > 0:
            batch_left -= 1
            await answered(http, hal0d, "nightly", body("chat", stream=True))

    workers = [asyncio.create_task(nightly()) for _ in range(3)]
    await eventually(lambda: _serving(http, hal0d, "b"), STARTUP_S, "b serving the batch")
    with capture_logs() as logs:
        await answered(http, hal0d, "chat", body("reasoning", "long", max_tokens=5, stream=True))
    # b's turn is 15 s and its batch had work left: only the class ended its turn.
    assert batch_left > 0, "the batch was over before the chat was answered"
    evicted = [line for line in logs if line["event"] == "slot.evicting"]
    assert [line["slot"] for line in evicted] == ["b"], evicted
    assert "chat" not in evicted[0]["why"] and "interactive work" in evicted[0]["why"], evicted
    await asyncio.gather(*workers)  # and the batch is served to its end


async def test_without_classes_the_chat_waits_for_the_batchs_turn(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The same as above with the nightly key interactive too: b's priced turn holds it for as
    long as its work lasts, so the chat is answered only once the whole batch was served."""
    hal0d = await two_models(start_hal0d, tmp_path, "batch", classes=False)
    batch_left = 30

    async def nightly() -> None:
        nonlocal batch_left
        while batch_left > 0:
            batch_left -= 1
            await answered(http, hal0d, "nightly", body("chat", stream=True))

    workers = [asyncio.create_task(nightly()) for _ in range(3)]
    await eventually(lambda: _serving(http, hal0d, "b"), STARTUP_S, "b serving the batch")
    assert batch_left > 0, "the whole batch was sent before the chat came"
    await answered(http, hal0d, "chat", body("reasoning", "long", max_tokens=5, stream=True))
    assert batch_left == 0, f"{batch_left} of the batch were left when the chat was answered"
    await asyncio.gather(*workers)


async def _serving(http: aiohttp.ClientSession, hal0d: TestServer, slot: str) -> bool:
    return await state_of(http, hal0d, slot) == "serving"


async def test_batch_work_does_not_swap_out_a_model_while_its_interactive_work_is_in_flight(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """fifo swaps for any request at once; batch work waits for the chat's stream to end."""
    hal0d = await two_models(start_hal0d, tmp_path, "fifo")
    await answered(http, hal0d, "chat", body("reasoning", "long", max_tokens=2, stream=True))
    with capture_logs() as logs:
        chat = asyncio.create_task(answered(http, hal0d, "chat", body(
            "reasoning", "long", max_tokens=300, stream=True)))  # ~1.5 s
        await eventually(lambda: _serving(http, hal0d, "a"), STARTUP_S, "the chat's stream")
        await answered(http, hal0d, "nightly", body("chat", stream=True))
        await chat
    evicted = [line for line in logs if line["event"] == "slot.evicting"]
    assert [line["slot"] for line in evicted] == ["a"], evicted
    # Gone once the chat's stream had ended, not while it was in flight (fifo's way).
    assert evicted[0]["in_flight"] == 0, evicted


async def test_a_model_loaded_for_batch_work_takes_none_of_it_while_a_chats_load_comes_next(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """b loads for the batch; a chat for a arrives meanwhile. b, once up, takes none of its
    batch (a's load would unload it and the chat would wait for a whole batch answer): it
    goes empty, a loads, the chat is answered, then b comes back for its batch."""
    hal0d = await two_models(start_hal0d, tmp_path, "batch")
    await answered(http, hal0d, "chat", body("reasoning", "long", max_tokens=2, stream=True))
    with capture_logs() as logs:
        batch = [asyncio.create_task(answered(http, hal0d, "nightly", body(
            "chat", stream=True))) for _ in range(4)]
        await eventually(lambda: _state_is(http, hal0d, "b", "starting"), STARTUP_S,
                         "b loading for the batch")
        await answered(http, hal0d, "chat", body("reasoning", "long", max_tokens=2, stream=True))
        await asyncio.gather(*batch)
    evicted = [(line["slot"], line["in_flight"]) for line in logs
               if line["event"] == "slot.evicting"]
    # a for b's first load (idle), then b for the chat, empty: it took none of its batch.
    assert evicted[:2] == [("a", 0), ("b", 0)], evicted


async def _state_is(http: aiohttp.ClientSession, hal0d: TestServer, slot: str,
                    state: str) -> bool:
    return await state_of(http, hal0d, slot) == state
