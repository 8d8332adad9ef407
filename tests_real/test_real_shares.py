"""A shared box on a real llama-server running SmolLM2-135M (one sequence, so one answer at a
time): a chat key's requests go ahead of a batch key's queued before them, and a key's daily
quota is counted from the server's own usage figures, then refused with the reset time.

Run by `make test-real` (HAL0D_REAL_SERVER, HAL0D_REAL_MODEL); about 15 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
from realserver import free_port, require_real_server, running_hal0d, server_command

PORT = free_port()
SECRETS = {"chat": "sk-real-chat-5Tq", "nightly": "sk-real-nightly-8Wz", "kid": "sk-real-kid-2Ry",
           "admin": "sk-real-admin-6Ux"}


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    config = {
        "server": {"anonymous": {"scopes": ["read"]}},  # the harness's polls, from loopback
        "keys": [
            {"name": "chat", "key": SECRETS["chat"], "scopes": ["inference"]},
            {"name": "nightly", "key": SECRETS["nightly"], "scopes": ["inference"],
             "class": "batch"},
            {"name": "kid", "key": SECRETS["kid"], "scopes": ["inference"],
             "tokens_per_day": 120},
            {"name": "admin", "key": SECRETS["admin"], "scopes": ["admin"]},
        ],
        "slots": [{"name": "smol", "upstream": f"http://127.0.0.1:{PORT}",
                   "models": ["smollm2"], "max_concurrent": 1, "max_queue": 32,
                   "command": server_command("smollm2", PORT)}],
    }
    folder = tmp_path_factory.mktemp("shares")
    with running_hal0d(folder, config, lambda views: views["smol"]["state"] == "ready") as base:
        yield base


def client(base: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=SECRETS[key], max_retries=0)


async def counts(base: str) -> tuple[int, int]:
    """The slot's requests in flight and queued."""
    async with aiohttp.ClientSession() as http, http.get(f"{base}/api/slots") as resp:
        view = next(v for v in (await resp.json())["slots"] if v["name"] == "smol")
        return int(view["in_flight"]), int(view["queued"])


async def until(base: str, in_flight: int, queued: int) -> None:
    while await counts(base) != (in_flight, queued):  # noqa: ASYNC110 (an HTTP view: no event)
        await asyncio.sleep(0.02)


def test_the_chat_goes_ahead_of_the_batch_queued_before_it(hal0d: str) -> None:
    async def run() -> list[str]:
        answered: list[str] = []

        async def ask(who: str, tokens: int) -> None:
            stream = await client(hal0d, who).chat.completions.create(
                model="smollm2", max_tokens=tokens, stream=True,
                messages=[{"role": "user", "content": "Tell me a long story about a ship."}])
            async for _ in stream:
                pass
            answered.append(who)

        first = asyncio.create_task(ask("nightly", 400))
        await until(hal0d, 1, 0)
        batch = [asyncio.create_task(ask("nightly", 8)) for _ in range(4)]
        await until(hal0d, 1, 4)
        chats = [asyncio.create_task(ask("chat", 8)) for _ in range(2)]
        await until(hal0d, 1, 6)
        assert not first.done(), "the first answer ended before the queue was whole"
        await asyncio.gather(first, *batch, *chats)
        return answered

    assert asyncio.run(run()) == ["nightly", "chat", "chat", "nightly", "nightly", "nightly",
                                  "nightly"]


def test_a_daily_quota_counts_the_servers_usage_and_then_refuses(hal0d: str) -> None:
    async def run() -> tuple[int, list[Any], dict[str, Any]]:
        kid = client(hal0d, "kid")
        used = 0
        usages = []
        for _ in range(20):
            try:
                answer = await kid.chat.completions.create(
                    model="smollm2", max_tokens=20,
                    messages=[{"role": "user", "content": "Name a colour."}])
            except openai.RateLimitError as refused:
                async with aiohttp.ClientSession(headers={
                        "Authorization": f"Bearer {SECRETS['admin']}"}) as http, http.get(
                        f"{hal0d}/api/keys") as resp:
                    line = next(k for k in (await resp.json())["keys"] if k["name"] == "kid")
                return used, [refused.body, refused.response.headers.get("Retry-After"),
                              usages], line
            assert answer.usage is not None
            usages.append(answer.usage)
            used += answer.usage.prompt_tokens + answer.usage.completion_tokens
        raise AssertionError("never refused")

    used, (body, retry_after, usages), line = asyncio.run(run())
    assert used >= 120 and used - (usages[-1].prompt_tokens + usages[-1].completion_tokens) < 120
    # llama-server's own usage figures, summed, are what the quota counted.
    assert line["quotas"]["day"]["used"] == used, (line, used)
    assert isinstance(body, dict) and body["type"] == "insufficient_quota"
    assert "tokens_per_day is 120" in body["message"] and "resets at" in body["message"]
    assert retry_after is not None and 1 <= int(retry_after) <= 25 * 3600
