"""GET /api/events over real sockets: the slot state changes, load phases and finished requests of
a real on-demand slot (the stub, started as the slot's command), read by an independent SSE client
(aiohttp-sse-client); a reader that stops reading loses events (counted, and told) but delays
nobody; a reader that leaves is forgotten; shutdown ends the feed. And the hub itself, as a
playbook: events in, frames out."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import re
import socket
import time
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from hal0d.appkeys import EVENTS, LIFECYCLE
from hal0d.config import ServerConfig
from hal0d.handlers import admin
from hal0d.lifecycle.reload import ConfigDiff
from hal0d.observability import events
from hal0d.observability.events import EventHub
from hal0d.observability.history import RequestRecord
from hal0d.protocol.sse import Decoder
from tests.harness.client import Event, Reader, chat_body
from tests.harness.config import build_config, make_config, on_demand
from tests.harness.daemons import ServerFactory, start
from tests.harness.logs import logs_into_buffer
from tests.harness.poll import eventually
from tests.harness.stubs import STUB_MODELS, Stub

DROPPED = re.compile(rb"event: dropped\ndata: (\{[^\n]*\})\n\n")


def hub_of(hal0d: TestServer) -> EventHub:
    return hal0d.app[EVENTS]


# -- the lifecycle, as a page sees it ---------------------------------------------------------

async def test_a_load_a_request_and_an_unload_read_as_slot_load_and_request_events(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start(start_hal0d, build_config(tmp_path, on_demand("a", tmp_path)))
    reader = Reader(http, hal0d)
    hello = await reader.wait_for("hello", "the hello event")
    assert [(view["name"], view["state"]) for view in hello["slots"]] == [("a", "stopped")]
    assert hello["slots"][0]["start"] == "on_demand"

    async with http.post(hal0d.make_url("/api/slots/a/load")) as resp:
        assert resp.status == 200, await resp.text()
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body(stream=False)) as resp:
        assert resp.status == 200, await resp.text()
        request_id = resp.headers["X-Request-Id"]
    async with http.post(hal0d.make_url("/api/slots/a/unload")) as resp:
        assert resp.status == 200, await resp.text()
    await reader.wait_for("slot", "the slot stopped again", old="stopping", new="stopped")
    finished = await reader.wait_for("request", "the request event", request_id=request_id)

    slot_events = [data for data in reader.named("slot") if data["slot"] == "a"]
    states = [slot_events[0]["old"]] + [data["new"] for data in slot_events]
    assert states == ["stopped", "starting", "ready", "serving", "ready", "stopping", "stopped"]
    for data in slot_events:
        # Each carries the whole /api/slots view as it is right after the change.
        assert data["view"]["state"] == data["new"]
        assert data["view"]["in_flight"] == data["in_flight"]
        assert data["view"]["models"] == ["chat"]
    serving = slot_events[states.index("serving") - 1]
    assert (serving["in_flight"], serving["queued"]) == (1, 0)
    assert serving["view"]["pid"] is not None and serving["view"]["loaded_for_s"] is not None
    assert slot_events[-1]["reason"] == "unloaded (api)"

    phases = [data["phase"] for data in reader.named("load") if data["slot"] == "a"]
    assert phases[0] == "starting" and phases[-1] == "ready"
    assert set(phases) == {"starting", "probing", "ready"}
    assert all(data["elapsed_s"] >= 0 for data in reader.named("load"))
    unload = await reader.wait_for("unload", "the unload event", slot="a")
    assert unload["reason"] == "api" and unload["loaded_s"] is not None

    # The request event is the history row, field for field.
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        row = (await resp.json())["requests"][0]
    assert row["request_id"] == request_id
    for key, value in finished.items():
        if key in {"ok", "stream"}:
            assert bool(row[key]) == value
        else:
            assert row[key] == (pytest.approx(value) if isinstance(value, float) else value), key
    assert set(finished) == {field.name for field in dataclasses.fields(RequestRecord)}
    assert finished["slot"] == "a" and finished["status"] == 200
    await reader.close()


async def test_a_slot_a_reload_adds_is_in_the_feed_too(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    first = on_demand("a", tmp_path)
    config = build_config(tmp_path, first)
    hal0d = await start(start_hal0d, config)
    reader = Reader(http, hal0d)
    await reader.wait_for("hello", "the hello event")
    added = on_demand("b", tmp_path)
    lifecycle = hal0d.app[LIFECYCLE]
    await lifecycle.apply(ConfigDiff.between(lifecycle.configs, (first, added), {}))
    async with http.post(hal0d.make_url("/api/slots/b/load")) as resp:
        assert resp.status == 200, await resp.text()
    ready = await reader.wait_for("slot", "the added slot ready", slot="b", new="ready")
    assert ready["view"]["name"] == "b" and ready["view"]["pid"] is not None
    await reader.close()


# -- a reader that does not read --------------------------------------------------------------

def stuck_reader(port: int) -> socket.socket:
    """A raw connection that asks for the feed and then never reads, with a small receive buffer
    so that its backlog reaches hal0d's side soon."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    return sock


async def test_a_reader_that_stops_reading_delays_no_stream_and_its_drops_are_counted_and_told(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    hub = hub_of(hal0d)
    sock = stuck_reader(hal0d.port or 0)
    stuck = await eventually(lambda: next(iter(hub.subscribers), None), 10, "the raw reader")

    # Fill its queue: events are published as fast as the hub takes them, the way a busy box
    # would, until its queue is full and events for it are dropped.
    padding = "x" * 4000
    deadline = time.monotonic() + 60
    while not stuck.dropped:
        assert time.monotonic() < deadline, f"never behind: {stuck.pending} queued"
        for i in range(50):
            hub.publish("padding", {"i": i, "padding": padding})
        await asyncio.sleep(0.002)
    assert stuck.pending <= hub.queue_size + 1  # bounded: never queued beyond its limit

    # A well-behaved reader and a streamed completion meanwhile go at their own pace.
    reader = Reader(http, hal0d)
    await reader.wait_for("hello", "the second reader's hello")
    dropped_before = stuck.dropped
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        body = await resp.read()
        request_id = resp.headers["X-Request-Id"]
    took = time.monotonic() - started
    assert resp.status == 200 and body.rstrip().endswith(b"data: [DONE]")
    assert took < 5.0, f"a stream took {took:.1f} s next to a stuck feed reader"
    await reader.wait_for("request", "the request event", request_id=request_id)
    assert stuck.dropped > dropped_before  # the stream's events were not queued for it

    # Now it reads: everything queued, then a `dropped` event with the count, at the gap. (Each
    # frame is one write, so one HTTP chunk: a frame is whole between the chunk framing.)
    sock.setblocking(False)
    received = bytearray()
    told: list[dict[str, Any]] = []
    scanned = 0  # where the search for frames resumes (a frame may end in the next read)

    async def all_told() -> bool:
        nonlocal scanned
        loop = asyncio.get_running_loop()
        with contextlib.suppress(TimeoutError):
            while True:  # as much as there is now
                received.extend(await asyncio.wait_for(loop.sock_recv(sock, 1 << 20), 0.2))
        for match in DROPPED.finditer(received, scanned):
            told.append(orjson.loads(match.group(1)))
            scanned = match.end()
        scanned = max(scanned, len(received) - 200)
        return sum(payload["dropped"] for payload in told) == stuck.dropped

    await eventually(all_told, 30, "the stuck reader told of every dropped event")
    assert told[-1]["dropped_total"] == stuck.dropped

    # It leaves: its subscription goes at once (only the well-behaved reader remains).
    sock.close()
    await eventually(lambda: stuck not in hub.subscribers, 5, "the stuck reader forgotten")
    assert len(hub.subscribers) == 1
    await reader.close()
    await eventually(lambda: not hub.subscribers, 5, "the second reader forgotten")


# How long the next test's feed waits for a reader to take bytes: [dispatcher]'s
# max(stream_idle_timeout_s, direct_read_timeout_s), the bound a relayed stream's client has.
READER_BOUND_S = 1.0


async def test_a_reader_that_takes_no_bytes_for_the_client_bound_is_cut_and_forgotten(
    start_hal0d: ServerFactory, stub: Stub, http: aiohttp.ClientSession
) -> None:
    """A suspended `hal0d status --watch` or a stuck proxy: once the socket's buffers are full
    the feed's write waits on it, and after the bound a relayed stream's client has, its
    connection is aborted, its subscription dropped, and one line says so; a reader that reads
    meanwhile keeps its feed."""
    # A slot that serves many names: its view, in each of a request's two `slot` events, is some
    # kilobytes, so a few hundred requests fill the socket's buffers.
    many = (*STUB_MODELS, *(f"fine-tune-{i:04d}-of-a-long-family-name" for i in range(200)))
    hal0d = await start_hal0d(stub.url, models=many, dispatcher={
        "stream_idle_timeout_s": READER_BOUND_S / 2, "direct_read_timeout_s": READER_BOUND_S})
    hub = hub_of(hal0d)
    with logs_into_buffer("json", "info") as buffer:
        sock = stuck_reader(hal0d.port or 0)
        stuck = await eventually(lambda: next(iter(hub.subscribers), None), 10, "the raw reader")
        reader = Reader(http, hal0d)
        await reader.wait_for("hello", "the reading reader's hello")

        # Requests until the feed's write waits on the stuck reader: its handler takes each frame
        # the moment it is queued unless it is blocked in a write, so frames that stay queued
        # say it is (the write began before that, so the cut comes within the bound of it).
        async def one() -> None:
            async with http.post(hal0d.make_url("/v1/chat/completions"),
                                 json=chat_body(stream=False)) as resp:
                assert resp.status == 200, await resp.text()

        enough = asyncio.Event()

        async def produce() -> None:
            while not enough.is_set():
                await asyncio.gather(*(one() for _ in range(16)))

        producer = asyncio.create_task(produce())
        deadline = time.monotonic() + 60
        while stuck.pending < 20:
            assert time.monotonic() < deadline, "the feed's write never waited on its reader"
            assert stuck in hub.subscribers, "cut before its write waited on it"
            if producer.done():
                producer.result()  # its failure, if it failed
            await asyncio.sleep(0.005)
        blocked = time.monotonic()
        enough.set()
        await eventually(lambda: stuck not in hub.subscribers, READER_BOUND_S + 3,
                         "the stuck reader's feed ended")
        took = time.monotonic() - blocked
        assert took < READER_BOUND_S + 2, f"cut {took:.1f} s after its write waited"
        await producer

        def lines(event: str) -> list[dict[str, Any]]:
            parsed = [orjson.loads(line) for line in buffer.getvalue().splitlines()]
            return [e for e in parsed if e["event"] == event]

        stalled = await eventually(lambda: lines("events.reader_stalled"), 5, "the stall line")
        assert len(stalled) == 1 and stalled[0]["bound_s"] == READER_BOUND_S, stalled
        assert stalled[0]["level"] == "warning"
        done = await eventually(
            lambda: [e for e in lines("request.done") if e["path"] == "/api/events"], 5,
            "the cut feed's request.done")
        assert [(e["ok"], e["error_code"]) for e in done] == [(False, "client_stalled")], done

    # What was in the socket's buffers when it was aborted, and then its end, with no last
    # chunk (a cut, not an end of stream).
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    received = bytearray()
    async with asyncio.timeout(10):
        try:
            while chunk := await loop.sock_recv(sock, 1 << 20):
                received.extend(chunk)
        except ConnectionResetError:
            pass
    sock.close()
    assert received.startswith(b"HTTP/1.1 200 OK\r\n") and b"event: hello" in received
    assert not received.endswith(b"\r\n0\r\n\r\n")

    # The reader that read was not cut, and still gets what happens.
    assert len(hub.subscribers) == 1 and not reader.ended
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body(stream=False)) as resp:
        request_id = resp.headers["X-Request-Id"]
    await reader.wait_for("request", "a later request event", request_id=request_id)
    await reader.close()


# -- keys, heartbeats, shutdown ---------------------------------------------------------------

async def test_the_feed_needs_a_key_when_keys_are_set(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    config = make_config(stub.url, tmp_path=tmp_path)
    keyed = dataclasses.replace(
        config, server=ServerConfig(api_keys=("sk-feed",), accepted_keys=frozenset({"sk-feed"})))
    hal0d = await start_hal0d(stub.url, config=keyed)
    async with http.get(hal0d.make_url("/api/events")) as resp:
        assert resp.status == 401
        assert "API key" in (await resp.json())["error"]["message"]
    assert not hub_of(hal0d).subscribers
    reader = Reader(http, hal0d, headers={"Authorization": "Bearer sk-feed"})
    hello = await reader.wait_for("hello", "hello with the key")
    assert [view["name"] for view in hello["slots"]] == ["llm"]
    await reader.close()


async def test_a_reload_that_changes_a_slot_shows_its_new_view_in_the_feed(
    start_hal0d: ServerFactory, tmp_path: Any, http: aiohttp.ClientSession
) -> None:
    first = on_demand("a", tmp_path)
    hal0d = await start(start_hal0d, build_config(tmp_path, first))
    reader = Reader(http, hal0d)
    await reader.wait_for("hello", "the hello event")
    changed = dataclasses.replace(first, models=("chat", "tool"))
    lifecycle = hal0d.app[LIFECYCLE]
    await lifecycle.apply(ConfigDiff.between(lifecycle.configs, (changed,), {}))
    event = await reader.wait_for("slot", "the changed slot's view", slot="a", reason="reloaded")
    assert event["view"]["models"] == ["chat", "tool"]
    assert event["old"] == event["new"] == "stopped"
    await reader.close()


async def test_a_reader_that_leaves_ends_its_feed_normally_not_as_a_failed_request(
    start_hal0d: ServerFactory, stub: Stub, http: aiohttp.ClientSession
) -> None:
    """A closed status page is how a feed ends: its request.done says ok, so the README's
    `journalctl -g 'request.done.*ok=False'` lists failures, not page closes."""
    hal0d = await start_hal0d(stub.url)
    with logs_into_buffer("json", "info") as buffer:
        async with http.get(hal0d.make_url("/api/events"),
                            headers={"X-Request-Id": "a-page-closed"}) as resp:
            assert (await resp.content.readany()).startswith(b"event: hello")

        def done() -> dict[str, Any]:
            lines = [orjson.loads(line) for line in buffer.getvalue().splitlines()]
            found = [e for e in lines if e["event"] == "request.done"
                     and e.get("request_id") == "a-page-closed"]
            assert len(found) == 1, found
            return found[0]

        line = await eventually(done, 5, "the feed's request.done")
    assert (line["path"], line["ok"], line["error_code"]) == ("/api/events", True, None), line


async def test_a_quiet_feed_sends_a_heartbeat_comment(
    start_hal0d: ServerFactory, stub: Stub, http: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admin, "HEARTBEAT_S", 0.2)
    hal0d = await start_hal0d(stub.url)
    async with http.get(hal0d.make_url("/api/events")) as resp:
        assert resp.content_type == "text/event-stream"  # a charset may follow
        assert resp.headers["Cache-Control"] == "no-cache"
        assert "Content-Encoding" not in resp.headers
        seen = b""
        async with asyncio.timeout(10):
            while b": heartbeat\n\n" not in seen:
                seen += await resp.content.readany()
    assert seen.startswith(b"event: hello\ndata: ")


async def test_shutdown_ends_an_open_feed_at_once(
    start_hal0d: ServerFactory, stub: Stub, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    reader = Reader(http, hal0d)
    await reader.wait_for("hello", "hello")
    started = time.monotonic()
    await hal0d.close()
    assert time.monotonic() - started < 5.0
    await eventually(lambda: reader.ended, 5, "the reader saw its stream end")
    await reader.close()


# -- the hub, as a playbook ------------------------------------------------------------------

def decoded(frames: list[bytes]) -> list[Event]:
    decoder = Decoder()
    return [(e.event or "", orjson.loads(e.data)) for f in frames for e in decoder.feed(f)]


async def drain(subscriber: events.Subscriber) -> list[bytes]:
    """What the subscriber has for its reader now (a short wait says there is no more)."""
    out = []
    while True:
        try:
            async with asyncio.timeout(0.05):
                data = await subscriber.next()
        except TimeoutError:
            return out
        if data is None:
            return out
        out.append(data)


async def test_a_full_queue_drops_and_tells_the_count_where_the_gap_is() -> None:
    hub = EventHub(queue_size=3)
    subscriber = hub.subscribe()
    for i in range(5):
        hub.publish("n", {"i": i})
    assert subscriber.dropped == 2 and subscriber.pending == 3
    assert decoded(await drain(subscriber)) == [
        ("n", {"i": 0}), ("n", {"i": 1}), ("n", {"i": 2}),
        ("dropped", {"dropped": 2, "dropped_total": 2}),
    ]
    for i in range(5, 9):
        hub.publish("n", {"i": i})
    hub.publish("n", {"i": 9})
    frames = await drain(subscriber)
    assert decoded(frames) == [
        ("n", {"i": 5}), ("n", {"i": 6}), ("n", {"i": 7}),
        ("dropped", {"dropped": 2, "dropped_total": 4}),
    ]
    hub.publish("n", {"i": 10})  # room again: the gap would be told before it, had there been one
    assert decoded(await drain(subscriber)) == [("n", {"i": 10})]


async def test_the_gap_goes_before_the_next_event_that_fits() -> None:
    hub = EventHub(queue_size=1)
    subscriber = hub.subscribe()
    hub.publish("n", {"i": 0})
    hub.publish("n", {"i": 1})  # dropped
    assert await subscriber.next() is not None
    hub.publish("n", {"i": 2})
    assert decoded(await drain(subscriber)) == [
        ("dropped", {"dropped": 1, "dropped_total": 1}), ("n", {"i": 2}),
    ]


async def test_closing_the_hub_ends_every_reader_after_what_it_has_queued() -> None:
    hub = EventHub()
    subscriber = hub.subscribe()
    hub.publish("n", {"i": 0})
    waiting = asyncio.create_task(hub.subscribe().next())
    await asyncio.sleep(0)
    hub.close()
    assert await waiting is None
    assert decoded([await subscriber.next() or b""]) == [("n", {"i": 0})]
    assert await subscriber.next() is None
    assert await hub.subscribe().next() is None  # a latecomer is ended at once


def test_nobody_listening_costs_nothing_and_unsubscribing_forgets_the_queue() -> None:
    hub = EventHub()
    hub.publish("n", {"unserializable": object()})  # not even encoded: nobody listens
    subscriber = hub.subscribe()
    hub.unsubscribe(subscriber)
    hub.publish("n", {"i": 1})
    assert subscriber.pending == 0 and not hub.subscribers

