"""Slot lifecycle over real sockets: a lease is held while a client drains its stream, released on
every exit path, and the per-slot queue admits in order, refuses with 429 and forgets who left."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer

from hal0d.config import SlotConfig
from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import ROLE_CHUNK, STUB_MODELS, content_chunk

CHAT = "/v1/chat/completions"



async def slot_view(
    http: aiohttp.ClientSession, hal0d: TestServer, name: str = "llm"
) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert resp.status == 200
        slots = (await resp.json())["slots"]
    return next(s for s in slots if s["name"] == name)


async def wait_slot(
    http: aiohttp.ClientSession,
    hal0d: TestServer,
    check: Callable[[dict[str, Any]], bool],
    timeout: float = 1.0,
    name: str = "llm",
) -> dict[str, Any]:
    """Poll GET /api/slots until `check` holds for the slot; fail with the last view if not."""
    async def matching() -> dict[str, Any]:
        view = await slot_view(http, hal0d, name)
        assert check(view), view
        return view

    return await eventually(matching, timeout, f"slot {name!r} in the awaited state")


def idle(view: dict[str, Any]) -> bool:
    return view["state"] == "ready" and view["in_flight"] == 0 and view["queued"] == 0


class Gate:
    """An upstream that records the order requests arrive in and holds each one until the test
    opens its gate. The tag is the request's user message."""

    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self._gates: dict[str, asyncio.Event] = {}

    def gate(self, tag: str) -> asyncio.Event:
        return self._gates.setdefault(tag, asyncio.Event())

    def open(self, *tags: str) -> None:
        for tag in tags:
            self.gate(tag).set()

    async def handler(self, request: web.Request) -> web.Response:
        body = await request.json()
        tag = body["messages"][-1]["content"]
        self.arrivals.append(tag)
        await self.gate(tag).wait()
        return web.json_response(
            {
                "id": tag,
                "object": "chat.completion",
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": tag},
                        "finish_reason": "stop",
                    }
                ],
            }
        )

    async def wait_arrivals(self, count: int, timeout: float = 1.0) -> None:
        await eventually(lambda: len(self.arrivals) >= count, timeout,
                         f"{count} requests at the upstream")


async def post_tagged(
    http: aiohttp.ClientSession, hal0d: TestServer, tag: str
) -> tuple[int, dict[str, str], Any]:
    body = chat_body(stream=False, content=tag)
    async with http.post(hal0d.make_url(CHAT), json=body, headers={"X-Request-Id": tag}) as resp:
        return resp.status, dict(resp.headers), await resp.json()


async def recent_rows(
    http: aiohttp.ClientSession, hal0d: TestServer, count: int, timeout: float = 2.0
) -> dict[str, dict[str, Any]]:
    """The newest history rows by request id, once at least `count` are written."""
    async def written() -> dict[str, dict[str, Any]]:
        async with http.get(hal0d.make_url("/api/requests"), params={"limit": "50"}) as resp:
            rows = (await resp.json())["requests"]
        assert len(rows) >= count, rows
        return {row["request_id"]: row for row in rows}

    return await eventually(written, timeout, f"{count} history rows")


# -- GET /api/slots --------------------------------------------------------------------------


async def test_api_slots_lists_every_slot_with_state_capacity_and_the_error_reason(
    stub, start_hal0d, http
):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_hal0d(
        stub.url,
        slot={"max_concurrent": 3},
        extra_slots=(SlotConfig(name="gone", upstream=dead, models=("ghost",)),),
    )
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        assert resp.status == 200
        slots = (await resp.json())["slots"]
    assert [s["name"] for s in slots] == ["llm", "gone"]
    llm, gone = slots
    assert llm == {
        "name": "llm",
        "state": "ready",
        "reason": None,
        "upstream": stub.url,
        "models": list(STUB_MODELS),
        "in_flight": 0,
        "queued": 0,
        "max_concurrent": 3,
        "group": None,
        "memory_mib": None,
        "group_memory_mib": None,
        "group_max_loaded": None,
        "load": None,  # a load's phase while one is under way
        "conversations_warm": 0,  # none served yet
        "prompt_cache": None,  # a slot hal0d does not start saves no caches
        "context": None,  # no context key, and its server was never asked (docs/contexts.md)
    }
    assert gone["state"] == "error"
    assert "cannot connect" in gone["reason"]
    assert (gone["upstream"], gone["models"], gone["in_flight"]) == (dead, ["ghost"], 0)


# -- serving until drained, released on every exit path ---------------------------------------


async def test_slot_stays_serving_while_a_client_reads_slowly_and_is_ready_once_it_drained(
    upstream_app, start_hal0d, http
):
    # Far more than the socket buffers between upstream, hal0d and client can hold, sent as fast
    # as possible: once the client stops reading, hal0d is held at its write, not at the upstream.
    pad = "x" * 32 * 1024
    events = 1200
    upstream_done = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(ROLE_CHUNK)
        chunk = content_chunk(pad)
        for _ in range(events):
            await response.write(chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        upstream_done.set()
        return response

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": upstream}))
    async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
        assert resp.status == 200
        received = 0
        for _ in range(5):
            received += len(await resp.content.readline())
            await asyncio.sleep(0.1)  # kept: a client that reads slowly is the behaviour here
            view = await slot_view(http, hal0d)
            assert (view["state"], view["in_flight"]) == ("serving", 1), view
        assert not upstream_done.is_set(), "the test needs a stream larger than the buffers"
        received += len(await resp.read())
        drained = time.monotonic()
    view = await wait_slot(http, hal0d, idle, timeout=1.0)
    assert time.monotonic() - drained < 0.5, view
    assert received > events * len(pad)
    assert upstream_done.is_set()


async def test_slot_is_released_after_the_client_disconnects_mid_stream(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    body = chat_body("reasoning", content="long", max_tokens=100_000)
    resp = await http.post(hal0d.make_url(CHAT), json=body)
    assert resp.status == 200
    await resp.content.readline()
    await resp.content.readline()
    view = await slot_view(http, hal0d)
    assert (view["state"], view["in_flight"]) == ("serving", 1)
    resp.close()
    await wait_slot(http, hal0d, idle, timeout=1.0)


async def test_slot_is_released_after_a_stall_guard_trip(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, dispatcher={"stream_idle_timeout_s": 0.3})
    async with http.post(hal0d.make_url(CHAT), json=chat_body("stall")) as resp:
        await resp.content.readline()
        view = await slot_view(http, hal0d)
        assert (view["state"], view["in_flight"]) == ("serving", 1)
        started = time.monotonic()
        raw = await resp.read()
    assert b"x_hal0_stall" in raw and raw.endswith(b"data: [DONE]\n\n")
    assert 0.2 < time.monotonic() - started < 2.0
    await wait_slot(http, hal0d, idle, timeout=0.5)


async def test_slot_is_released_after_the_upstream_resets_the_stream(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url(CHAT), json=chat_body("broken")) as resp:
        assert resp.status == 200
        raw = await resp.read()
    assert b"dispatch.upstream_broken" in raw
    assert any(line.split()[1] == "breaking" for line in stub.lines())
    await wait_slot(http, hal0d, idle, timeout=0.5)


async def test_slot_in_error_is_still_tried_and_a_dead_upstream_502_leaves_nothing_held(
    start_hal0d, http
):
    hal0d = await start_hal0d(f"http://127.0.0.1:{free_port()}")
    before = await slot_view(http, hal0d)
    assert before["state"] == "error"
    for _ in range(3):  # a leaked unit would show up as in_flight, or as a hang on the next one
        async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
            assert resp.status == 502
            assert (await resp.json())["error"]["code"] == "dispatch.upstream_unavailable"
    after = await slot_view(http, hal0d)
    assert (after["state"], after["in_flight"], after["queued"]) == ("error", 0, 0)


async def test_two_hundred_concurrent_streams_with_a_random_half_disconnecting_leave_the_slot_idle(
    start_stub, start_hal0d
):
    stub = await start_stub(delay=0.005)
    hal0d = await start_hal0d(stub.url, slot={"max_concurrent": 64, "max_queue": 200})
    rng = random.Random(4)
    leaving = set(rng.sample(range(200), 100))
    body = chat_body("reasoning", max_tokens=20)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(
        connector=connector, timeout=aiohttp.ClientTimeout(total=30)
    ) as http:

        async def client(index: int) -> str:
            async with http.post(hal0d.make_url(CHAT), json=body) as resp:
                assert resp.status == 200
                if index in leaving:
                    for _ in range(rng.randint(1, 4)):
                        await resp.content.readline()
                    resp.close()
                    return "left"
                raw = await resp.read()
                assert raw.endswith(b"data: [DONE]\n\n")
                return "done"

        results = await asyncio.gather(*(client(i) for i in range(200)))
        assert results.count("left") == 100 and results.count("done") == 100
        await wait_slot(http, hal0d, idle, timeout=2.0)
        async with http.get(hal0d.make_url("/api/slots/metrics")) as resp:
            assert (await resp.json())["slots"][0]["requests"] == 200
        async with http.post(hal0d.make_url(CHAT), json=body) as resp:
            assert resp.status == 200
            assert (await resp.read()).endswith(b"data: [DONE]\n\n")
        await wait_slot(http, hal0d, idle, timeout=0.5)


# -- the queue --------------------------------------------------------------------------------


async def test_queue_admits_in_arrival_order_and_refuses_past_max_queue_with_429(
    upstream_app, start_hal0d, http
):
    gate = Gate()
    url = await upstream_app({"POST /v1/chat/completions": gate.handler})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1, "max_queue": 2})
    first = asyncio.create_task(post_tagged(http, hal0d, "r0"))
    await gate.wait_arrivals(1)
    waiting = []
    for queued, tag in enumerate(("r1", "r2"), start=1):
        waiting.append(asyncio.create_task(post_tagged(http, hal0d, tag)))
        await wait_slot(http, hal0d, lambda v, n=queued: v["queued"] == n)

    started = time.monotonic()
    status, headers, error = await post_tagged(http, hal0d, "r3")
    assert time.monotonic() - started < 0.5  # refused at once, not after the queue timeout
    assert status == 429
    assert int(headers["Retry-After"]) >= 1
    assert error["error"]["code"] == "slot.queue_full"
    assert error["error"]["type"] == "rate_limit_error"

    await asyncio.sleep(0.2)  # so the waiters' queue_ms has something to show
    gate.open("r0", "r1", "r2")
    results = await asyncio.gather(first, *waiting)
    assert [r[0] for r in results] == [200, 200, 200]
    assert [r[2]["id"] for r in results] == ["r0", "r1", "r2"]
    assert gate.arrivals == ["r0", "r1", "r2"]
    assert idle(await slot_view(http, hal0d))

    rows = await recent_rows(http, hal0d, 4)
    assert rows["r0"]["queue_ms"] < 100
    assert rows["r1"]["queue_ms"] >= 190 and rows["r2"]["queue_ms"] >= 190
    assert (rows["r3"]["status"], rows["r3"]["ok"], rows["r3"]["error_code"]) == (
        429,
        False,
        "queue_full",
    )


async def test_a_waiter_past_queue_timeout_gets_429_with_retry_after_and_leaves_the_queue(
    upstream_app, start_hal0d, http
):
    gate = Gate()
    url = await upstream_app({"POST /v1/chat/completions": gate.handler})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1, "queue_timeout_s": 0.3})
    first = asyncio.create_task(post_tagged(http, hal0d, "r0"))
    await gate.wait_arrivals(1)
    started = time.monotonic()
    status, headers, error = await post_tagged(http, hal0d, "r1")
    waited = time.monotonic() - started
    assert status == 429
    assert 0.25 < waited < 2.0
    assert int(headers["Retry-After"]) >= 1
    assert error["error"]["code"] == "slot.queue_full"
    view = await slot_view(http, hal0d)
    assert (view["state"], view["in_flight"], view["queued"]) == ("serving", 1, 0)
    gate.open("r0")
    assert (await first)[0] == 200
    assert gate.arrivals == ["r0"]


async def test_a_queued_client_that_disconnects_leaves_the_queue_at_once(
    upstream_app, start_hal0d, http
):
    gate = Gate()
    url = await upstream_app({"POST /v1/chat/completions": gate.handler})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1, "max_queue": 1})
    first = asyncio.create_task(post_tagged(http, hal0d, "r0"))
    await gate.wait_arrivals(1)
    leaver = asyncio.create_task(post_tagged(http, hal0d, "r1"))
    await wait_slot(http, hal0d, lambda v: v["queued"] == 1)
    leaver.cancel()  # the client closes its connection while queued
    left = time.monotonic()
    await wait_slot(http, hal0d, lambda v: v["queued"] == 0, timeout=0.5)
    assert time.monotonic() - left < 0.5
    # With max_queue 1, a newcomer is only admitted to the queue because the leaver is gone.
    later = asyncio.create_task(post_tagged(http, hal0d, "r2"))
    await wait_slot(http, hal0d, lambda v: v["queued"] == 1)
    gate.open("r0", "r1", "r2")
    assert (await first)[0] == 200 and (await later)[0] == 200
    assert gate.arrivals == ["r0", "r2"]  # the leaver never reached the upstream
    rows = await recent_rows(http, hal0d, 3)
    assert (rows["r1"]["ok"], rows["r1"]["error_code"]) == (False, "client_disconnect")
    assert idle(await slot_view(http, hal0d))
