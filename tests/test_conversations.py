"""Conversations and their affinity: the key a request's conversation gets on each surface (the
client's own, else its stable prefix), the bounded memory of which slot served it, and, over
real sockets, a route over two replicas that keeps each conversation on the replica that holds
it, spilling to the other only while that one has no free place."""

from __future__ import annotations

import asyncio
import time
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d import conversations
from hal0d.appkeys import SLOTS
from hal0d.config import parse
from hal0d.conversations import Affinity
from tests.harness.config import route_config
from tests.harness.daemons import ServerFactory
from tests.harness.poll import eventually
from tests.harness.stubs import StubFactory, Upstream, answering_stream

SYSTEM = {"role": "system", "content": "You are a careful coding agent."}


def turns(first: str, n: int) -> list[dict[str, Any]]:
    """A conversation's messages at its n-th turn (1-based): the same start, more after it."""
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": first}]
    for turn in range(1, n):
        messages += [{"role": "assistant", "content": f"answer {turn}"},
                     {"role": "user", "content": f"and then {turn}?"}]
    return messages


# -- the key --------------------------------------------------------------------------------


def test_a_chat_conversation_keeps_its_key_from_turn_to_turn_and_another_gets_its_own() -> None:
    key = conversations.of_chat({}, {"model": "m", "messages": turns("fix the bug", 1)})
    assert key is not None
    for n in (2, 5):
        assert conversations.of_chat({}, {"model": "m", "messages": turns("fix the bug", n)}) == key
    assert conversations.of_chat({}, {"model": "m", "messages": turns("write docs", 3)}) != key
    assert conversations.of_chat({}, {"model": "other", "messages": turns("fix the bug", 1)}
                                 ) != key
    with_tools = {"model": "m", "messages": turns("fix the bug", 1),
                  "tools": [{"type": "function", "function": {"name": "sh"}}]}
    assert conversations.of_chat({}, with_tools) != key
    assert conversations.of_chat({}, {"model": "m", "messages": [SYSTEM]}) is None


def test_the_clients_own_key_wins_over_the_prefix() -> None:
    body = {"model": "m", "messages": turns("fix the bug", 1)}
    cached = conversations.of_chat({}, {**body, "prompt_cache_key": "session-1"})
    assert cached != conversations.of_chat({}, body)
    # The same session, whatever its messages: Codex's prompt_cache_key, or a session header.
    assert conversations.of_chat({}, {"model": "m", "messages": turns("other", 2),
                                      "prompt_cache_key": "session-1"}) == cached
    headed = conversations.of_chat({"x-session-id": "s-9"}, body)
    assert headed == conversations.of_chat({"x-session-id": "s-9"},
                                           {"model": "m", "messages": turns("x", 3)})
    assert headed != cached


def test_anthropic_and_responses_requests_get_their_keys_too() -> None:
    claude = {"model": "m", "system": "sys", "messages": [{"role": "user", "content": "hi"}],
              "metadata": {"user_id": "user_ab_account_cd_session_ef"}}
    assert conversations.of_messages({}, claude) == conversations.of_messages(
        {}, {**claude, "messages": [{"role": "user", "content": "later"}]})
    plain = {"model": "m", "system": "sys", "messages": [{"role": "user", "content": "hi"}]}
    assert conversations.of_messages({}, plain) != conversations.of_messages(
        {}, {**plain, "system": "another"})
    codex = {"model": "m", "instructions": "be brief", "input": "hello",
             "prompt_cache_key": "019a-session"}
    assert conversations.of_responses({}, codex) == conversations.of_responses(
        {}, {**codex, "input": [{"role": "user", "content": "other"}]})
    bare = {"model": "m", "instructions": "be brief", "input": "hello"}
    assert conversations.of_responses({}, bare) == conversations.of_responses(
        {}, {**bare, "input": [{"role": "user", "content": "hello"},
                               {"role": "assistant", "content": "hi"}]})


def test_a_legacy_prompt_is_keyed_by_its_start() -> None:
    long = "x" * 10_000
    assert conversations.of_chat({}, {"model": "m", "prompt": long}) == conversations.of_chat(
        {}, {"model": "m", "prompt": long + " and more"})
    assert conversations.of_chat({}, {"model": "m", "input": "embed me"}) is None


# -- the memory -------------------------------------------------------------------------------


def test_affinity_remembers_a_bounded_number_of_conversations_least_recent_first_out() -> None:
    affinity = Affinity(size=3)
    for n, slot in enumerate(["a", "b", "a", "b"]):
        affinity.served(f"c{n}", slot)
    assert affinity.slot_for("c0") is None  # the oldest went
    assert [affinity.slot_for(f"c{n}") for n in (1, 2, 3)] == ["b", "a", "b"]
    assert (affinity.warm("a"), affinity.warm("b")) == (1, 2)
    affinity.served("c1", "a")  # its next turn went elsewhere: it is that slot's now
    assert (affinity.slot_for("c1"), affinity.warm("a"), affinity.warm("b")) == ("a", 2, 1)
    assert affinity.conversations("a") == ["c1", "c2"]  # the most recent first


def test_affinity_forgets_after_its_time_to_live_and_a_slot_that_went_cold() -> None:
    affinity = Affinity(ttl_s=0.05)
    affinity.served("c", "a")
    assert affinity.slot_for("c") == "a"
    time.sleep(0.06)
    assert affinity.slot_for("c") is None and affinity.warm("a") == 0
    affinity = Affinity()
    for key in ("x", "y"):
        affinity.served(key, "a")
    affinity.served("z", "b")
    assert affinity.forget_slot("a") == 2
    assert (affinity.slot_for("x"), affinity.slot_for("z"), affinity.warm("a")) == (None, "b", 0)
    affinity.adopt("a", ["y", "x", "z"])  # a restored cache holds them again; z moved on
    assert (affinity.slot_for("x"), affinity.slot_for("y"), affinity.slot_for("z")) == (
        "a", "a", "b")
    assert affinity.conversations("a") == ["y", "x"]


# -- over real sockets ------------------------------------------------------------------------


async def start_route(start_hal0d: ServerFactory, first: str, second: str, tmp_path: Path,
                      route: str = "spill_when_busy = true") -> TestServer:
    text = route_config(first, second, tmp_path, route=route,
                        first_slot="max_concurrent = 1", second_slot="max_concurrent = 1")
    return await start_hal0d("http://unused", config=parse(tomllib.loads(text),
                                                            base_dir=tmp_path))


async def turn(http: aiohttp.ClientSession, hal0d: TestServer, messages: list[dict[str, Any]],
               ) -> str:
    """One turn, streamed; the slot that answered it (its history row)."""
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json={"model": "qwen", "stream": True, "messages": messages}) as resp:
        body = await resp.read()
        assert resp.status == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-300:]
        request_id = resp.headers["X-Request-Id"]
    for _ in range(100):
        async with http.get(hal0d.make_url("/api/requests?limit=20")) as rows:
            for row in (await rows.json())["requests"]:
                if row["request_id"] == request_id:
                    return str(row["slot"])
        await asyncio.sleep(0.02)
    raise AssertionError(f"no history row for {request_id}")


async def test_each_conversation_stays_on_the_replica_that_served_it(
    start_hal0d: ServerFactory, start_stub: StubFactory, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    """Four conversations over two replicas, two at a time, four turns each: every turn of a
    conversation reaches the replica its first turn did. In each later round the conversation
    held by the second replica asks first, so a plan in configured order would hand it the
    first replica."""
    first, second = await start_stub(delay=0.02), await start_stub(delay=0.02)
    hal0d = await start_route(start_hal0d, first.url, second.url, tmp_path)
    table = hal0d.app[SLOTS]

    async def in_order(asks_first: str, then: str, n: int) -> dict[str, str]:
        """Turn n of `asks_first`, and of `then` once the first holds its slot (or is over):
        the slot each turn reached."""
        leading = asyncio.create_task(turn(http, hal0d, turns(asks_first, n)))
        await eventually(lambda: leading.done() or sum(slot.in_flight for slot in table) == 1,
                         5.0, f"{asks_first}'s turn {n} on its slot")
        following = await turn(http, hal0d, turns(then, n))
        return {asks_first: await leading, then: following}

    served: dict[str, list[str]] = {}
    for pair in (("alpha", "beta"), ("gamma", "delta")):
        opening = await asyncio.gather(*(turn(http, hal0d, turns(name, 1)) for name in pair))
        assert sorted(opening) == ["one", "two"], opening  # the second spilled
        for name, slot in zip(pair, opening, strict=True):
            served[name] = [slot]
        later = sorted(pair, key=lambda name: served[name][0] == "one")  # two's first
        for n in (2, 3, 4):
            for name, slot in (await in_order(later[0], later[1], n)).items():
                served[name].append(slot)
    assert {name: set(slots) for name, slots in served.items()} == {
        name: {slots[0]} for name, slots in served.items()}, served
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        warm = {view["name"]: view["conversations_warm"] for view in (await resp.json())["slots"]}
    assert warm == {"one": 2, "two": 2}


async def test_a_conversation_spills_to_the_free_replica_while_its_own_is_full(
    start_hal0d: ServerFactory, start_stub: StubFactory, upstream_app: Upstream,
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """The warm replica is busy with no free place: the turn goes to the free one at once (never
    waits for the warm one), and the conversation is that replica's from then on."""
    release = asyncio.Event()

    async def first_replica(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["messages"][-1]["content"] == "hold":
            await release.wait()
        return await answering_stream(request)

    one = await upstream_app({"POST /v1/chat/completions": first_replica})
    two = await start_stub()
    hal0d = await start_route(start_hal0d, one, two.url, tmp_path)
    assert await turn(http, hal0d, turns("refactor", 1)) == "one"
    holding = asyncio.ensure_future(turn(http, hal0d, [{"role": "user", "content": "hold"}]))
    try:
        for _ in range(200):
            async with http.get(hal0d.make_url("/api/slots")) as resp:
                views = {v["name"]: v for v in (await resp.json())["slots"]}
            if views["one"]["in_flight"] == 1:
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()
        assert await turn(http, hal0d, turns("refactor", 2)) == "two"
        assert time.monotonic() - started < 5.0  # not held until the warm replica is free
    finally:
        release.set()
        assert await holding == "one"
    assert await turn(http, hal0d, turns("refactor", 3)) == "two"  # it lives there now


async def test_a_failover_route_keeps_its_order(
    start_hal0d: ServerFactory, start_stub: StubFactory, upstream_app: Upstream,
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A route that neither spills nor prefers loaded slots is a failover order: its first slot
    is the preferred one. A conversation the second slot served while the first failed goes
    back to the first once it answers again."""
    calls = 0

    async def fails_once(request: web.Request) -> web.StreamResponse:
        nonlocal calls
        calls += 1
        if calls == 1:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        return await answering_stream(request)

    one = await upstream_app({"POST /v1/chat/completions": fails_once})
    two = await start_stub()
    hal0d = await start_route(start_hal0d, one, two.url, tmp_path, route="")
    assert [await turn(http, hal0d, turns("same", n)) for n in (1, 2, 3)] == [
        "two", "one", "one"]


# -- per client -------------------------------------------------------------------------------

ALICE, BOB = "hal0-alice-key-7Qm2x", "hal0-bob-key-9Lp4z"
KEYS = f"""
[[keys]]
name = "alice"
key = "{ALICE}"
scopes = ["inference", "read"]

[[keys]]
name = "bob"
key = "{BOB}"
scopes = ["inference", "read"]
"""


async def keyed_turn(http: aiohttp.ClientSession, hal0d: TestServer, key: str,
                     messages: list[dict[str, Any]], session: str | None = None) -> str:
    """One streamed turn with `key` (and the session header `session`): the slot that answered
    it (its history row)."""
    headers = {"Authorization": f"Bearer {key}"}
    if session is not None:
        headers["x-session-id"] = session
    async with http.post(hal0d.make_url("/v1/chat/completions"), headers=headers,
                         json={"model": "qwen", "stream": True, "messages": messages}) as resp:
        body = await resp.read()
        assert resp.status == 200 and body.rstrip().endswith(b"data: [DONE]"), body[-300:]
        request_id = resp.headers["X-Request-Id"]
    rows: list[dict[str, Any]] = []

    async def recorded() -> bool:
        async with http.get(hal0d.make_url("/api/requests?limit=20"), headers=headers) as got:
            rows[:] = [row for row in (await got.json())["requests"]
                       if row["request_id"] == request_id]
        return bool(rows)

    await eventually(recorded, 5.0, f"the history row of {request_id}")
    return str(rows[0]["slot"])


async def test_two_clients_opening_alike_or_sending_one_session_id_keep_their_own_slots(
    start_hal0d: ServerFactory, start_stub: StubFactory, upstream_app: Upstream,
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Alice's conversation is on replica one. Bob opens his the same way ("hi", or alice's
    session id) while one is busy, so his turn spills to two: alice's next turn still goes to
    one, where her conversation is warm (with one key for both, bob's turn would have moved it
    to two)."""
    release = asyncio.Event()

    async def first_replica(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["messages"][-1]["content"] == "hold":
            await release.wait()
        return await answering_stream(request)

    one = await upstream_app({"POST /v1/chat/completions": first_replica})
    two = await start_stub()
    text = route_config(one, two.url, tmp_path, route="spill_when_busy = true",
                        first_slot="max_concurrent = 1", second_slot="max_concurrent = 1")
    hal0d = await start_hal0d("http://unused", config=parse(tomllib.loads(KEYS + text),
                                                            base_dir=tmp_path))
    table = hal0d.app[SLOTS]
    for session in (None, "s-alice"):
        assert await keyed_turn(http, hal0d, ALICE, turns("hi", 1), session) == "one"
        release.clear()
        holding = asyncio.ensure_future(
            keyed_turn(http, hal0d, ALICE, [{"role": "user", "content": "hold"}]))
        await eventually(lambda: table["one"].in_flight == 1, 5.0, "replica one busy")
        assert await keyed_turn(http, hal0d, BOB, turns("hi", 1), session) == "two"
        release.set()
        assert await holding == "one"
        assert await keyed_turn(http, hal0d, ALICE, turns("hi", 2), session) == "one", session
        assert await keyed_turn(http, hal0d, BOB, turns("hi", 2), session) == "two", session
