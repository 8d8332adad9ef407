"""A box several keys share, over real sockets with the stub as the slot's command: interactive
work goes before batch work in a slot's queue; batch work past `batch_max_wait_s` goes first;
keys of one class get equal tokens, not equal requests; a waiting stream hears how many are
ahead of it; GET /api/keys shows each key's use to the admin scope alone."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp.test_utils import TestServer

from hal0d.config import DispatcherConfig, KeyConfig
from tests.harness.client import CHAT, body
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, ServerFactory, start
from tests.harness.poll import eventually

SECRETS = {"chat": "sk-chat-7Qx9", "nightly": "sk-nightly-Pz4", "short": "sk-short-Wm2",
           "long": "sk-long-Kd8", "viewer": "sk-viewer-Rt5", "admin": "sk-admin-Hb3"}


def key(name: str, scopes: tuple[str, ...] = ("inference", "read"), **share: Any) -> KeyConfig:
    return KeyConfig(name=name, scopes=scopes, key=SECRETS[name], secret=SECRETS[name], **share)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {SECRETS[name]}"}


def stream(tokens: int, text: str = "long") -> dict[str, Any]:
    """A streamed answer of `tokens` tokens (the stub streams one each 5 ms)."""
    return body("reasoning", text, max_tokens=tokens, stream=True)


async def ask(http: aiohttp.ClientSession, hal0d: TestServer, who: str, request: dict[str, Any],
              answered: list[str]) -> None:
    async with http.post(hal0d.make_url(CHAT), json=request, headers=auth(who)) as resp:
        whole = await resp.read()
        assert resp.status == 200 and whole.endswith(b"data: [DONE]\n\n"), whole[-300:]
    answered.append(who)


async def serving(start_hal0d: ServerFactory, tmp_path: Path, *keys: KeyConfig,
                  **dispatcher: Any) -> TestServer:
    """hal0d with one slot of max_concurrent = 1 (the stub serving "reasoning"), loaded."""
    slot = on_demand("a", tmp_path, models=("reasoning",), max_concurrent=1, max_queue=64,
                     queue_timeout_s=60.0)
    if not any(given.name == "admin" for given in keys):
        keys = (*keys, key("admin", ("read", "admin")))
    hal0d = await start(start_hal0d, build_config(tmp_path, slot, keys=keys,
                                                  dispatcher=DispatcherConfig(**dispatcher)))
    async with aiohttp.ClientSession() as http:
        await ask(http, hal0d, keys[0].name, stream(2), [])
    return hal0d


async def slot_a(http: aiohttp.ClientSession, hal0d: TestServer) -> dict[str, Any]:
    """The slot's view in /api/slots, read with a key of every test's ("read" scope)."""
    async with http.get(hal0d.make_url("/api/slots"), headers=auth("admin")) as resp:
        assert resp.status == 200, await resp.text()
        return next(view for view in (await resp.json())["slots"] if view["name"] == "a")


async def queued_at_least(http: aiohttp.ClientSession, hal0d: TestServer, count: int) -> None:
    async def enough() -> bool:
        return (await slot_a(http, hal0d))["queued"] >= count

    await eventually(enough, STARTUP_S, f"{count} requests queued")


async def test_interactive_work_goes_ahead_of_batch_work_queued_before_it(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await serving(start_hal0d, tmp_path, key("chat"), key("nightly", service_class="batch"))
    answered: list[str] = []
    first = asyncio.create_task(ask(http, hal0d, "nightly", stream(400), answered))  # ~2 s
    await eventually(lambda: _in_flight(http, hal0d), STARTUP_S, "the first batch answer")
    tasks = [asyncio.create_task(ask(http, hal0d, "nightly", stream(20), answered))
             for _ in range(5)]
    await queued_at_least(http, hal0d, 5)
    tasks += [asyncio.create_task(ask(http, hal0d, "chat", stream(20), answered))
              for _ in range(4)]
    await queued_at_least(http, hal0d, 9)
    assert not first.done(), "the first batch answer ended before the queue was whole"
    await asyncio.gather(first, *tasks)
    # Round robin between the two keys would have alternated them.
    assert answered == ["nightly"] + ["chat"] * 4 + ["nightly"] * 5, answered


async def _in_flight(http: aiohttp.ClientSession, hal0d: TestServer) -> bool:
    return (await slot_a(http, hal0d))["in_flight"] == 1


async def test_batch_work_that_waited_batch_max_wait_s_goes_ahead_of_interactive_work(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await serving(start_hal0d, tmp_path, key("chat"), key("nightly", service_class="batch"),
                          batch_max_wait_s=0.5)
    answered: list[str] = []
    flood = asyncio.Semaphore(3)  # the chat key keeps three requests waiting or answered

    async def chatting() -> None:
        async with flood:
            await ask(http, hal0d, "chat", stream(30), answered)  # ~0.15 s each

    chats = [asyncio.create_task(chatting()) for _ in range(20)]
    await queued_at_least(http, hal0d, 2)
    await ask(http, hal0d, "nightly", stream(5), answered)
    await asyncio.gather(*chats)
    async with http.get(hal0d.make_url("/api/requests"), params={"key": "nightly"},
                        headers=auth("admin")) as resp:
        row = (await resp.json())["requests"][0]
    # Held back behind the chats for its bound, then first: not behind all 20 of them.
    assert row["service_class"] == "batch" and row["queue_ms"] >= 500.0, row
    assert answered.index("nightly") < len(answered) - 8, answered


async def test_keys_of_one_class_get_equal_tokens_when_one_sends_prompts_ten_times_longer(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await serving(start_hal0d, tmp_path, key("short"), key("long"))
    words = "the quick brown fox jumps over the lazy dog " * 5  # ~50 prompt tokens
    prompts = {"short": words, "long": words * 10}
    done = asyncio.Event()
    sent = {"short": 0, "long": 0}

    async def client(who: str) -> None:
        while not done.is_set():
            sent[who] += 1
            await ask(http, hal0d, who, body("reasoning", prompts[who], max_tokens=2,
                                             stream=True), [])

    # Both keys keep two requests waiting at all times, for as long as it takes the short key
    # to send 120: a long request is then a twentieth of either key's tokens.
    clients = [asyncio.create_task(client(who)) for who in ("short", "long") for _ in range(2)]
    await eventually(lambda: sent["short"] >= 120, 120.0, "the short key's 120 requests")
    # What each used while both were waiting (the requests still queued then are the tail).
    async with http.get(hal0d.make_url("/api/keys"), headers=auth("admin")) as resp:
        assert resp.status == 200
        used = {line["name"]: line["window_tokens"] for line in (await resp.json())["keys"]}
    done.set()
    await asyncio.gather(*clients)
    assert abs(used["short"] - used["long"]) <= 0.1 * max(used.values()), used
    assert sent["short"] > 4 * sent["long"], sent  # equal tokens, so far from equal requests


async def test_a_waiting_streams_keepalive_counts_down_the_requests_ahead_of_it(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await serving(start_hal0d, tmp_path, key("chat"), key("nightly", service_class="batch"),
                          keepalive_s=0.05)
    tasks = [asyncio.create_task(ask(http, hal0d, "nightly", stream(60), []))
             for _ in range(4)]  # one answered, three waiting
    await queued_at_least(http, hal0d, 3)
    async with http.post(hal0d.make_url(CHAT), json=stream(5), headers=auth("nightly")) as resp:
        whole = (await resp.read()).decode()
    await asyncio.gather(*tasks)
    said = re.findall(r": hal0d: queued for a, (\d+) ahead \(batch\)", whole)
    counts = [int(ahead) for ahead in dict.fromkeys(said)]  # each count once, in order
    assert counts == [3, 2, 1, 0], whole[:600]
    assert whole.endswith("data: [DONE]\n\n")


async def test_api_keys_shows_each_keys_share_to_the_admin_scope_alone(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await serving(
        start_hal0d, tmp_path, key("nightly", service_class="batch", weight=2.0,
                                   tokens_per_day=100000),
        key("viewer", ("inference", "read")), key("admin", ("admin",)))
    async with http.get(hal0d.make_url("/api/keys"), headers=auth("admin")) as resp:
        assert resp.status == 200, await resp.text()  # the admin scope alone is enough
    async with http.get(hal0d.make_url("/api/keys"), headers=auth("viewer")) as resp:
        assert resp.status == 403, await resp.text()
        assert "admin" in (await resp.json())["error"]["message"]
    async with http.get(hal0d.make_url("/api/keys")) as resp:
        assert resp.status == 401
    async with http.get(hal0d.make_url("/api/keys"), headers=auth("admin")) as resp:
        assert resp.status == 200
        shown = {line["name"]: line for line in (await resp.json())["keys"]}
    nightly = shown["nightly"]
    assert (nightly["class"], nightly["weight"]) == ("batch", 2.0)
    assert nightly["window_tokens"] > 0 and nightly["window_tokens"] == sum(
        nightly["last_hour_tokens"])
    assert nightly["quotas"]["day"]["limit"] == 100000
    assert nightly["quotas"]["day"]["used"] == nightly["window_tokens"]
    assert (nightly["queued"], nightly["in_flight"]) == (0, 0)
    assert shown["viewer"]["class"] == "interactive" and shown["viewer"]["window_tokens"] == 0
    async with http.get(hal0d.make_url("/metrics")) as resp:
        counted = dict(re.findall(r'^hal0d_key_tokens_total\{key="([^"]*)"\} (\S+)$',
                                  await resp.text(), re.MULTILINE))
    assert counted == {"nightly": f"{float(nightly['window_tokens'])}"}, counted
