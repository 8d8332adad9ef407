"""A request's history row over real sockets: in the real SQLite file, the ok and error_code of
every exit path, the model the client named (routed or not) and the usage the upstream reported;
GET /api/requests gives the newest rows first and refuses a bad limit."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from hal0d.appkeys import RUNTIME
from tests.harness.client import CHAT, chat_body
from tests.harness.observe import api_row, db_row, get_json, headers
from tests.harness.ports import free_port

# -- history rows in SQLite, one per exit path -------------------------------------------------


async def read_all(resp: aiohttp.ClientResponse) -> None:
    await resp.read()


async def leave_mid_stream(resp: aiohttp.ClientResponse) -> None:
    await resp.content.readline()
    resp.close()


async def upstream_500(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "boom"}}, status=500)


async def upstream_503(request: web.Request) -> web.Response:
    return web.json_response({"error": {"message": "loading"}}, status=503)


@dataclass
class ExitPath:
    upstream: str  # "stub", "dead", or the name of a handler in UPSTREAMS
    body: dict[str, Any]
    status: int
    ok: bool
    error_code: str | None
    dispatcher: dict[str, Any] = field(default_factory=dict)
    read: Callable[[aiohttp.ClientResponse], Awaitable[None]] = read_all
    slot: str | None = "llm"


UPSTREAMS = {"500": upstream_500, "503": upstream_503}
EXIT_PATHS = {
    "normal": ExitPath("stub", chat_body("chat"), 200, True, None),
    "client_disconnect": ExitPath(
        "stub",
        chat_body("reasoning", content="long", max_tokens=100_000),
        200,
        False,
        "client_disconnect",
        read=leave_mid_stream,
    ),
    "stall_idle": ExitPath(
        "stub",
        chat_body("stall"),
        200,
        False,
        "stream_stall_idle",
        dispatcher={"stream_idle_timeout_s": 0.3},
    ),
    "stall_total": ExitPath(
        "stub",
        chat_body("chatty"),
        200,
        False,
        "stream_stall_total",
        dispatcher={"stream_total_timeout_s": 0.3, "stream_idle_timeout_s": 5.0},
    ),
    "dead_upstream": ExitPath("dead", chat_body("chat"), 502, False, "upstream_unavailable"),
    "upstream_500_stream": ExitPath("500", chat_body("chat"), 500, False, "upstream_status_500"),
    "upstream_503_whole": ExitPath(
        "503", chat_body("chat", stream=False), 503, False, "upstream_status_503"
    ),
    "upstream_reset": ExitPath("stub", chat_body("broken"), 200, False, "upstream_broken"),
    "unknown_model": ExitPath("stub", chat_body("nope"), 404, False, "no_route", slot=None),
}


@pytest.mark.parametrize("case", list(EXIT_PATHS))
async def test_history_row_in_sqlite_has_the_ok_and_error_code_of_each_exit_path(
    case, stub, upstream_app, start_hal0d, http
):
    path = EXIT_PATHS[case]
    if path.upstream == "stub":
        url = stub.url
    elif path.upstream == "dead":
        url = f"http://127.0.0.1:{free_port()}"
    else:
        url = await upstream_app({"POST /v1/chat/completions": UPSTREAMS[path.upstream]})
    hal0d = await start_hal0d(url, dispatcher=path.dispatcher)
    request_id = f"exit-{case}"
    async with http.post(hal0d.make_url(CHAT), json=path.body, headers=headers(request_id)) as resp:
        assert resp.status == path.status
        await path.read(resp)
    database = hal0d.app[RUNTIME].current.config.database_path()
    assert database.name == "history.sqlite3"
    row = await db_row(database, request_id)
    assert (row["status"], row["ok"], row["error_code"]) == (
        path.status,
        int(path.ok),
        path.error_code,
    )
    assert row["slot"] == path.slot
    assert row["endpoint"] == CHAT
    assert row["total_ms"] > 0 and abs(row["ts"] - time.time()) < 60
    if path.slot is not None:
        assert row["stream"] == int(path.body["stream"])
        assert row["model"] == path.body["model"]
        assert row["queue_ms"] is not None and row["queue_ms"] >= 0


async def test_history_row_names_the_model_the_client_asked_for_even_when_unrouted(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url)
    for request_id, model in (("routed", "chat"), ("unrouted", "no-such-model")):
        async with http.post(
            hal0d.make_url(CHAT), json=chat_body(model, stream=False), headers=headers(request_id)
        ) as resp:
            await resp.read()
        row = await db_row(tmp_path / "history.sqlite3", request_id)
        assert row["model"] == model, row


async def test_history_row_carries_the_usage_the_upstream_reported(
    stub, start_hal0d, http, tmp_path
):
    hal0d = await start_hal0d(stub.url)
    body = chat_body("reasoning", stream_options={"include_usage": True})
    async with http.post(hal0d.make_url(CHAT), json=body, headers=headers("u1")) as resp:
        raw = await resp.read()
    events = [e for e in raw.split(b"\n\n") if e and e != b"data: [DONE]"]
    usage = orjson.loads(events[-1][len(b"data: ") :])["usage"]
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 1
    row = await db_row(tmp_path / "history.sqlite3", "u1")
    with closing(sqlite3.connect(tmp_path / "history.sqlite3")) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert (row["ok"], row["error_code"]) == (1, None)
    assert (row["prompt_tokens"], row["completion_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert 0 <= row["ttft_ms"] <= row["total_ms"]


# -- GET /api/requests ---------------------------------------------------------------------------


async def test_api_requests_returns_the_newest_rows_first_up_to_limit(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    for request_id in ("first", "second", "third"):
        async with http.post(
            hal0d.make_url(CHAT), json=chat_body(stream=False), headers=headers(request_id)
        ) as resp:
            assert resp.status == 200
    await api_row(http, hal0d, "third")
    rows = (await get_json(http, hal0d, "/api/requests?limit=2"))["requests"]
    assert [r["request_id"] for r in rows] == ["third", "second"]
    assert set(rows[0]) >= {
        "ts",
        "request_id",
        "slot",
        "model",
        "endpoint",
        "stream",
        "status",
        "ok",
        "error_code",
        "queue_ms",
        "ttft_ms",
        "total_ms",
        "prompt_tokens",
        "completion_tokens",
    }
    assert (rows[0]["ok"], rows[0]["stream"], rows[0]["slot"]) == (True, False, "llm")


@pytest.mark.parametrize("limit", ["0", "abc", "-1", "1001", "2.5", "\u00b2"])
async def test_api_requests_refuses_a_bad_limit_with_a_400_envelope(limit, stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.get(hal0d.make_url("/api/requests"), params={"limit": limit}) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error",
        "request.invalid",
        "limit",
    )
