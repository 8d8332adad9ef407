"""A disconnect storm: 500 streams at once, a seeded random half of the clients dropped at random
moments (right after sending, while queued, mid-stream). Afterwards every generation of a dropped
client was cancelled upstream, every slot is idle, no task and no file descriptor is left over,
and hal0d serves the next request normally."""

from __future__ import annotations

import asyncio
import os
import random
import re
import socket
import sqlite3
import struct
import time
from collections import Counter
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d_stub.app import make_stub_app
from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.ports import free_port

STREAMS = 500
SEED = 8_2026
MAX_CONCURRENT = 100
MAX_QUEUE = 600
STUB_DELAY_S = 0.005  # 200+ tokens: every generation runs for more than a second
BODY = chat_body("reasoning", content="long", max_tokens=200)
LINE = re.compile(r"^\S+ (start|end|cancelled) rid=(\w+)")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def stub_generations(log: Path) -> dict[str, list[str]]:
    """rid -> the events the stub logged for it, in order."""
    seen: dict[str, list[str]] = {}
    for line in log.read_text().splitlines() if log.exists() else ():
        if match := LINE.match(line):
            seen.setdefault(match[2], []).append(match[1])
    return seen


def server_connections() -> int:
    """Connections hal0d and the stub still serve: aiohttp runs one task for each, and it ends
    only after the connection's request handler has returned."""
    return sum(1 for task in asyncio.all_tasks()
               if getattr(task.get_coro(), "__qualname__", "") == "RequestHandler.start")


async def history_rows(hal0d: TestServer) -> list[dict[str, Any]]:
    """GET /api/requests, which flushes the history writer first: every request whose handler
    has returned is in the file once this returns."""
    async with aiohttp.ClientSession() as http, http.get(
        hal0d.make_url("/api/requests?limit=1")
    ) as resp:
        return list((await resp.json())["requests"])


def storm_rows(path: Path) -> dict[int, dict[str, Any]]:
    with closing(sqlite3.connect(path)) as conn:
        conn.row_factory = sqlite3.Row
        rows = conn.execute("SELECT * FROM requests WHERE request_id LIKE 'storm-%'").fetchall()
    return {int(row["request_id"].removeprefix("storm-")): dict(row) for row in rows}


async def slot_snapshot(http: aiohttp.ClientSession, hal0d: TestServer) -> list[dict[str, Any]]:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        return list((await resp.json())["slots"])


async def one_normal_stream(hal0d: TestServer) -> bytes:
    async with aiohttp.ClientSession() as http, http.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body("reasoning")
    ) as resp:
        assert resp.status == 200
        return await resp.read()


async def test_disconnect_storm_cancels_every_dropped_generation_and_leaks_nothing(
    aiohttp_server, start_hal0d, tmp_path
):
    log = tmp_path / f"stub-{free_port()}.log"
    stub_app = make_stub_app(log, STUB_DELAY_S)

    async def close_after_response(request: web.Request, response: web.StreamResponse) -> None:
        # No keep-alive to the upstream: once the storm is over every socket is closed, so
        # the descriptor and task counts go back to their baseline exactly, and anything
        # still open is a leak, not a pooled connection.
        # (The hook runs after aiohttp wrote its Connection header, so set it here too.)
        response.force_close()
        response.headers[hdrs.CONNECTION] = "close"

    stub_app.on_response_prepare.append(close_after_response)
    stub = await aiohttp_server(stub_app)
    hal0d = await start_hal0d(
        str(stub.make_url("")).rstrip("/"),
        slot={"max_concurrent": MAX_CONCURRENT, "max_queue": MAX_QUEUE},
    )
    url = hal0d.make_url("/v1/chat/completions")
    assert (await one_normal_stream(hal0d)).endswith(b"data: [DONE]\n\n")  # warm-up
    # The baseline is taken once the warm-up is over everywhere: its row written, its
    # generation ended, every connection (the row's read included) closed.
    await eventually(lambda: history_rows(hal0d), 5.0, "the warm-up's history row")
    await eventually(lambda: server_connections() == 0 and all(
        len(events) == 2 for events in stub_generations(log).values()), 5.0,
        "the warm-up's generation ended and its connections closed")
    # SQLite keeps a reader's descriptor open while another connection holds the file's locks:
    # read once now so that descriptor is in the baseline too.
    storm_rows(tmp_path / "history.sqlite3")
    current = asyncio.current_task()
    baseline_tasks = {t for t in asyncio.all_tasks() if t is not current}
    baseline_fds = open_fds()
    generations_before = len(stub_generations(log))

    rng = random.Random(SEED)
    dropped = set(rng.sample(range(STREAMS), STREAMS // 2))
    # How each dropped client leaves: right after its request is sent, at a random moment while
    # it waits (most of these are queued behind the 100 in flight; one whose answer starts first
    # leaves at the headers), or after reading a few lines of its stream.
    modes = {i: rng.choice(("after_send", "while_waiting", "mid_stream")) for i in dropped}
    wait_s = {i: rng.uniform(0.05, 0.8) for i in dropped}
    lines_read = {i: rng.randint(1, 6) for i in dropped}
    stage: dict[int, str] = {}
    tasks: dict[int, asyncio.Task[None]] = {}
    completed: dict[int, bytes] = {}
    statuses: Counter[int] = Counter()
    loop = asyncio.get_running_loop()

    async def on_sent(session: Any, ctx: SimpleNamespace, params: Any) -> None:
        i = ctx.trace_request_ctx["i"]
        stage[i] = "sent"
        if modes.get(i) == "after_send":
            loop.call_soon(tasks[i].cancel)
        elif modes.get(i) == "while_waiting":
            loop.call_later(wait_s[i], tasks[i].cancel)

    trace = aiohttp.TraceConfig()
    trace.on_request_chunk_sent.append(on_sent)

    async def client(http: aiohttp.ClientSession, i: int) -> None:
        async with http.post(url, json=BODY, headers={"X-Request-Id": f"storm-{i}"},
                             trace_request_ctx={"i": i}) as resp:
            stage[i] = "headers"
            statuses[resp.status] += 1
            if modes.get(i) == "while_waiting":
                # Its slot came before its moment to leave: it leaves now, at the headers.
                resp.close()
                return
            if modes.get(i) == "mid_stream":
                for _ in range(lines_read[i]):
                    await resp.content.readline()
                stage[i] = "mid_stream"
                resp.close()
                return
            completed[i] = await resp.read()

    started = time.monotonic()
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), trace_configs=[trace],
        timeout=aiohttp.ClientTimeout(total=60),
    ) as http:
        for i in range(STREAMS):
            tasks[i] = asyncio.create_task(client(http, i))
        async with asyncio.timeout(60):
            outcomes = await asyncio.gather(*tasks.values(), return_exceptions=True)
        storm_s = time.monotonic() - started
        errors = [(i, o) for i, o in zip(tasks, outcomes, strict=True)
                  if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        assert not errors, errors[:5]
        cancelled_clients = {i for i, t in tasks.items() if t.cancelled()}
        assert cancelled_clients <= dropped

        # Every client that stayed got its whole answer.
        kept = set(range(STREAMS)) - dropped
        assert set(completed) == kept, sorted(kept - set(completed))[:10]
        for i in kept:
            assert completed[i].endswith(b"data: [DONE]\n\n"), completed[i][-200:]
            assert completed[i].count(b'_content":"') + completed[i].count(b'"content":"') == 200
            assert b'"finish_reason":"length"' in completed[i], completed[i][-300:]

        # Every generation the stub started ended or was cancelled; the kept clients' ones ended,
        # so every one that reached the upstream for a dropped client was cancelled.
        def accounted() -> bool:
            gens = list(stub_generations(log).values())[generations_before:]
            return all(len(events) == 2 for events in gens)

        await eventually(accounted, 10.0, "every generation ended or cancelled")
        generations = list(stub_generations(log).values())[generations_before:]
        outcome = Counter(events[1] for events in generations)
        reached = len(generations) - len(kept)
        assert all(events[0] == "start" for events in generations)
        assert outcome["end"] == len(kept), outcome
        assert outcome["cancelled"] == reached, outcome

        # Every slot is idle again.
        async def idle() -> bool:
            slots = await slot_snapshot(http, hal0d)
            return all(s["in_flight"] == 0 and s["queued"] == 0 for s in slots)

        async def idle_now() -> bool:
            assert await idle(), await slot_snapshot(http, hal0d)
            return True

        await eventually(idle_now, 5.0, "every slot idle after the storm")

    # The history says what each client did: every kept stream ok, every dropped one that
    # reached hal0d a client_disconnect; those that never got a lease were dropped in the queue.
    await eventually(lambda: server_connections() == 0, 10.0, "every storm connection closed")
    await history_rows(hal0d)  # every handler has returned: this flushes the last of their rows
    rows = storm_rows(tmp_path / "history.sqlite3")
    assert kept <= set(rows)
    wrong = [(i, row["ok"], row["error_code"]) for i, row in rows.items()
             if (row["ok"], row["error_code"]) != (
                 (1, None) if i in kept else (0, "client_disconnect"))]
    assert not wrong, wrong[:10]
    dropped_rows = {i: row for i, row in rows.items() if i in dropped}
    queued_drops = sum(1 for row in dropped_rows.values() if row["queue_ms"] is None)
    mid_stream_drops = sum(1 for i in dropped if stage.get(i) == "mid_stream")
    before_headers = sum(1 for i in dropped if stage.get(i) not in ("headers", "mid_stream"))
    at_headers = sum(1 for i in dropped if stage.get(i) == "headers")
    assert queued_drops > 0 and mid_stream_drops > 0 and before_headers > 0, (
        queued_drops, mid_stream_drops, before_headers)
    assert set(statuses) == {200}, statuses

    # Nothing left over: the client session is closed, so every socket of the storm is gone.
    def tasks_back() -> bool:
        return len({t for t in asyncio.all_tasks() if t is not current}) <= len(baseline_tasks)

    def no_task_left() -> bool:
        leftover = {t for t in asyncio.all_tasks() if t is not current} - baseline_tasks
        assert tasks_back(), [t.get_coro() for t in leftover][:10]
        return True

    await eventually(no_task_left, 5.0, "the task count back at its baseline")
    tasks_after = len({t for t in asyncio.all_tasks() if t is not current})

    def no_fd_left() -> bool:
        assert open_fds() <= baseline_fds + 1, (baseline_fds, open_fds())
        return True

    await eventually(no_fd_left, 5.0, "the descriptor count back at its baseline")
    fds_after = open_fds()

    # And the daemon serves the next request normally.
    assert (await one_normal_stream(hal0d)).endswith(b"data: [DONE]\n\n")
    print(
        f"disconnect storm: {STREAMS} streams in {storm_s:.1f} s, {len(dropped)} clients dropped "
        f"({before_headers} before headers of which {queued_drops} while queued, {at_headers} at "
        f"the headers, {mid_stream_drops} mid-stream), {reached} of them had reached the "
        f"upstream and {outcome['cancelled']} generations were cancelled, {len(kept)} completed; "
        f"slots idle, tasks {len(baseline_tasks)} -> {tasks_after}, "
        f"fds {baseline_fds} -> {fds_after}; failures: 0"
    )


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/llm/v1/messages"])
async def test_a_client_leaving_as_the_upstream_answers_is_a_client_disconnect_not_a_500(
    path, upstream_app, start_hal0d, tmp_path
):
    """The race made exact: the upstream sends its headers and, in the same loop step, the
    client's socket is reset. hal0d's socket sees both before its next poll, so the handler
    resumes from the upstream's answer with the client already gone."""
    client: dict[str, socket.socket] = {}

    async def upstream(request: web.Request) -> web.StreamResponse:
        await request.read()
        # Upstream pacing, not a wait for an event: the Anthropic surface's token count (a
        # request of its own, none on the OpenAI surface) answers first.
        await asyncio.sleep(0.05)
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        client["socket"].close()  # no await in between: both land before hal0d's next poll
        await asyncio.sleep(0.5)  # the upstream's stream stays open and silent after it
        return response

    async def tokenize(request: web.Request) -> web.Response:
        return web.json_response({"tokens": [1, 2]})

    url = await upstream_app({"POST /v1/chat/completions": upstream, "POST /tokenize": tokenize})
    hal0d = await start_hal0d(url)
    body = orjson.dumps({"model": "chat", "stream": True, "max_tokens": 8,
                         "messages": [{"role": "user", "content": "hi"}]})
    sock = socket.create_connection(("127.0.0.1", hal0d.port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # a reset
    client["socket"] = sock
    with capture_logs() as events:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nX-Request-Id: leaves\r\n\r\n".encode() + body
        )
        def done() -> bool:
            assert any(e["event"] == "request.done" for e in events), events
            return True

        await eventually(done, 3.0, "request.done logged")
    done = next(e for e in events if e["event"] == "request.done")
    failed = [e for e in events if e["event"] == "request.failed"]
    assert (done["ok"], done["error_code"]) == (False, "client_disconnect") and not failed, (
        done, failed)
