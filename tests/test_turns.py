"""Turns between clients in a slot's queue, over real sockets with the stub as the slot's
command: one client's burst does not hold back another client's one request; requests that name
no client keep first come, first served."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from hal0d.observability.requestinfo import RequestInfo, client_of
from tests.harness.client import CHAT, body, chat, views
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.poll import eventually


def long(**extra: Any) -> dict[str, Any]:
    """A streamed request of about 0.2 s (the stub streams a token each 5 ms)."""
    return body("reasoning", "long", max_tokens=30, stream=True, **extra)


def test_a_client_is_its_key_else_the_bodys_user_else_the_anonymous_one() -> None:
    keyed = RequestInfo("r1", "chat/completions", key="team-a")
    plain = RequestInfo("r2", "chat/completions")
    assert client_of(keyed, {"user": "alice"}) == "key:team-a"
    assert client_of(plain, {"user": "alice"}) == "user:alice"
    assert client_of(plain, {"metadata": {"user_id": "bob"}}) == "user:bob"
    assert client_of(plain, {"user": "", "metadata": {"user_id": "bob"}}) == "user:bob"
    for nobody in (None, {}, {"user": 7}, {"metadata": "bob"}, {"metadata": {"user_id": ""}}):
        assert client_of(plain, nobody) == ""  # type: ignore[arg-type]
    assert client_of(keyed, None) == "key:team-a"


MESSAGES = "/llm/v1/messages"


def messages(**extra: Any) -> dict[str, Any]:
    return {"model": "reasoning", "max_tokens": 30, "stream": True,
            "messages": [{"role": "user", "content": "long"}], **extra}


async def answer_order(http: aiohttp.ClientSession, hal0d: TestServer,
                       burst: dict[str, Any], one: dict[str, Any], path: str = CHAT
                       ) -> list[str]:
    """A burst of 12 requests from one client queued on a slot of max_concurrent = 1, then one
    from another: the order they were answered in ('x' the burst's, 'y' the other's)."""
    answered: list[str] = []

    async def ask(who: str, request: dict[str, Any]) -> None:
        async with http.post(hal0d.make_url(path), json=request) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
        answered.append(who)

    tasks = [asyncio.create_task(ask("x", burst)) for _ in range(12)]

    async def all_queued() -> bool:
        view = (await views(http, hal0d))["a"]
        return view["queued"] + view["in_flight"] + len(answered) >= 12

    await eventually(all_queued, STARTUP_S, "the burst queued")
    assert len(answered) <= 2, answered
    tasks.append(asyncio.create_task(ask("y", one)))
    await asyncio.gather(*tasks)
    return answered


async def test_one_clients_request_behind_anothers_burst_of_12_is_answered_no_later_than_3rd(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, models=("reasoning",), max_concurrent=1)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    assert (await chat(http, hal0d, "reasoning"))[0] == 200  # loaded before the burst

    openai = await answer_order(http, hal0d, long(user="x"), long(user="y"))
    assert len(openai) == 13 and openai.index("y") <= 2, openai

    anthropic = await answer_order(http, hal0d, messages(metadata={"user_id": "x"}),
                                   messages(metadata={"user_id": "y"}), MESSAGES)
    assert len(anthropic) == 13 and anthropic.index("y") <= 2, anthropic


async def test_requests_that_name_no_client_are_served_first_come_first_served(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = on_demand("a", tmp_path, models=("reasoning",), max_concurrent=1)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    assert (await chat(http, hal0d, "reasoning"))[0] == 200
    order = await answer_order(http, hal0d, long(), long())
    assert order == ["x"] * 12 + ["y"], order
