"""Metrics over real sockets: TTFT and token figures from the stream tap, history rows in the real
SQLite file for every exit path, GET /api/requests, and /metrics read by prometheus_client's own
parser."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from collections.abc import Awaitable, Callable
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from prometheus_client.samples import Sample

from hal0d.appkeys import RUNTIME
from hal0d.config import Config, GroupConfig, MetricsConfig, SlotConfig
from tests.harness.client import chat as lifecycle_chat
from tests.harness.client import chat_body
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S
from tests.harness.observe import db_row, get_json, scrape, slot_metrics, value
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import ROLE_CHUNK, STUB_MODELS, content_chunk

CHAT = "/v1/chat/completions"
FINISH_CHUNK = b'data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n'
DONE = b"data: [DONE]\n\n"



def sse_upstream(*steps: bytes | float) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A streaming upstream that writes each bytes step and sleeps for each float step;
    float("inf") means silence until hal0d hangs up."""

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for step in steps:
            if isinstance(step, bytes):
                await response.write(step)
            elif step == float("inf"):
                await asyncio.Event().wait()
            else:
                await asyncio.sleep(step)
        await response.write_eof()
        return response

    return handler


async def api_row(
    http: aiohttp.ClientSession, hal0d: TestServer, request_id: str, timeout: float = 2.0
) -> dict[str, Any]:
    async def written() -> dict[str, Any]:
        rows = (await get_json(http, hal0d, "/api/requests?limit=100"))["requests"]
        found = [row for row in rows if row["request_id"] == request_id]
        assert found, rows
        return dict(found[0])

    return await eventually(written, timeout, f"the history row of {request_id}")


def headers(request_id: str) -> dict[str, str]:
    return {"X-Request-Id": request_id}


# -- TTFT and token figures from the stream tap -----------------------------------------------


async def test_ttft_skips_the_role_only_first_chunk(upstream_app, start_hal0d, http):
    url = await upstream_app(
        {
            "POST /v1/chat/completions": sse_upstream(
                ROLE_CHUNK,
                0.3,
                content_chunk("Hel"),
                content_chunk("lo"),
                FINISH_CHUNK,
                DONE,
            )
        }
    )
    hal0d = await start_hal0d(url)
    async with http.post(hal0d.make_url(CHAT), json=chat_body(), headers=headers("t1")) as resp:
        assert (await resp.read()).endswith(DONE)
    row = await api_row(http, hal0d, "t1")
    assert 300 <= row["ttft_ms"] < 2000
    assert row["ttft_ms"] <= row["total_ms"]
    ttft = (await slot_metrics(http, hal0d))["ttft_ms"]
    assert ttft["samples"] == 1
    assert 300 <= ttft["last"] < 2000 and ttft["p50"] == ttft["last"] == ttft["p95"]


async def test_the_stall_frame_is_no_token_and_no_ttft_sample(upstream_app, start_hal0d, http):
    url = await upstream_app({"POST /v1/chat/completions": sse_upstream(ROLE_CHUNK, float("inf"))})
    hal0d = await start_hal0d(url, dispatcher={"stream_idle_timeout_s": 0.3})
    async with http.post(hal0d.make_url(CHAT), json=chat_body(), headers=headers("s1")) as resp:
        raw = await resp.read()
    assert b"x_hal0_stall" in raw  # the client did get the frame, with its text content
    row = await api_row(http, hal0d, "s1")
    assert (row["ok"], row["error_code"]) == (False, "stream_stall_idle")
    assert row["ttft_ms"] is None
    assert not row["completion_tokens"]
    live = await slot_metrics(http, hal0d)
    assert live["ttft_ms"] == {"last": None, "p50": None, "p95": None, "samples": 0}
    assert (live["tokens"], live["tokens_per_s"], live["errors"]) == (0, None, 1)
    samples = await scrape(http, hal0d)
    assert not value(samples, "hal0d_ttft_seconds_count", slot="llm")
    assert not value(samples, "hal0d_generated_tokens_total", slot="llm")


async def test_tokens_per_second_follows_the_pace_of_a_stream_without_usage(
    upstream_app, start_hal0d, http
):
    steps: list[bytes | float] = [ROLE_CHUNK]
    for index in range(11):
        steps += [0.05, content_chunk(f"t{index}")]
    upstream = sse_upstream(*steps, FINISH_CHUNK, DONE)
    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": upstream}))
    async with http.post(hal0d.make_url(CHAT), json=chat_body(), headers=headers("p1")) as resp:
        await resp.read()
    row = await api_row(http, hal0d, "p1")
    # No usage chunk: counted from the `"delta"` markers (11 tokens and the finish chunk).
    assert 11 <= row["completion_tokens"] <= 12
    live = await slot_metrics(http, hal0d)
    assert 8 < live["tokens_per_s"] < 40  # about 20 tokens/s
    assert live["tokens"] == row["completion_tokens"]
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_tokens_per_second", slot="llm") == pytest.approx(
        live["tokens_per_s"], abs=0.001
    )


async def test_ttft_samples_are_kept_in_a_bounded_deque(stub, start_hal0d, tmp_path, http):
    config = Config(
        slots=(SlotConfig(name="llm", upstream=stub.url, models=STUB_MODELS),),
        metrics=MetricsConfig(database=str(tmp_path / "history.sqlite3"), ttft_samples=3),
        base_dir=tmp_path,
    )
    hal0d = await start_hal0d(stub.url, config=config)
    for _ in range(5):
        async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
            await resp.read()
    live = await slot_metrics(http, hal0d, requests=5)
    assert live["requests"] == 5
    assert live["ttft_ms"]["samples"] == 3


async def test_flm_usage_of_a_non_streaming_answer_shows_in_slot_metrics(
    upstream_app, start_hal0d, http
):
    async def flm(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "id": "x",
                "object": "chat.completion",
                "model": "chat",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {
                    "prompt_tokens": 7,
                    "completion_tokens": 9,
                    "total_tokens": 16,
                    "decoding_speed_tps": 17.5,
                    "kv_token_occupancy_rate_percentage": 42.25,
                },
            }
        )

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": flm}))
    async with http.post(
        hal0d.make_url(CHAT), json=chat_body(stream=False), headers=headers("f1")
    ) as resp:
        assert resp.status == 200
        assert (await resp.json())["usage"]["decoding_speed_tps"] == 17.5
    live = await slot_metrics(http, hal0d)
    assert live["decoding_speed_tps"] == 17.5
    assert live["kv_token_occupancy_rate_percentage"] == 42.25
    assert live["tokens_per_s"] == 17.5
    assert live["tokens"] == 9
    row = await api_row(http, hal0d, "f1")
    assert (row["stream"], row["prompt_tokens"], row["completion_tokens"], row["ttft_ms"]) == (
        False,
        7,
        9,
        None,
    )


async def test_a_streams_measured_speed_replaces_an_earlier_flm_figure(
    upstream_app, start_hal0d, http
):
    async def flm(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": "chat",
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 7,
                        "completion_tokens": 9,
                        "decoding_speed_tps": 500.0,
                    },
                }
            )
        steps: list[bytes | float] = [ROLE_CHUNK]
        for index in range(11):
            steps += [0.03, content_chunk(f"t{index}")]
        usage = b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":11}}\n\n'
        return await sse_upstream(*steps, FINISH_CHUNK, usage, DONE)(request)

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": flm}))
    async with http.post(hal0d.make_url(CHAT), json=chat_body(stream=False)) as resp:
        await resp.read()
    assert (await slot_metrics(http, hal0d))["tokens_per_s"] == 500.0
    async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
        await resp.read()
    live = await slot_metrics(http, hal0d, requests=2)
    assert live["tokens_per_s"] < 100, live  # about 33 tokens/s, measured on the stream


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


# -- /metrics ------------------------------------------------------------------------------------


async def test_metrics_parse_with_prometheus_client_and_cover_requests_slots_and_trips(
    stub, start_hal0d, http
):
    dead = f"http://127.0.0.1:{free_port()}"
    hal0d = await start_hal0d(
        stub.url,
        dispatcher={"stream_idle_timeout_s": 0.3},
        extra_slots=(SlotConfig(name="gone", upstream=dead, models=("ghost",)),),
    )
    for model in ("chat", "stall"):
        async with http.post(hal0d.make_url(CHAT), json=chat_body(model)) as resp:
            await resp.read()
    async with http.post(hal0d.make_url(CHAT), json=chat_body("ghost")) as resp:
        assert resp.status == 502
    await slot_metrics(http, hal0d, requests=2)
    samples = await scrape(http, hal0d)

    requests = {
        (s.labels["slot"], s.labels["model"], s.labels["outcome"]): s.value
        for s in samples["hal0d_requests_total"]
    }
    assert requests == {
        ("llm", "chat", "ok"): 1,
        ("llm", "stall", "stream_stall_idle"): 1,
        ("gone", "ghost", "upstream_unavailable"): 1,
    }
    assert {s.labels["endpoint"] for s in samples["hal0d_requests_total"]} == {CHAT}
    assert value(samples, "hal0d_request_duration_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_request_duration_seconds_bucket", slot="llm", le="+Inf") == 2
    assert value(samples, "hal0d_ttft_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_queue_wait_seconds_count", slot="llm") == 2
    assert value(samples, "hal0d_queue_wait_seconds_count", slot="gone") == 1
    assert value(samples, "hal0d_generated_tokens_total", slot="llm", model="chat") > 0
    assert value(samples, "hal0d_stall_guard_trips_total", slot="llm", reason="idle") == 1
    for slot, state in (("llm", "ready"), ("gone", "error")):
        states = {
            s.labels["state"]: s.value
            for s in samples["hal0d_slot_state"]
            if s.labels["slot"] == slot
        }
        assert set(states) == {"offline", "stopped", "starting", "ready", "serving", "error",
                               "stopping"}
        assert [name for name, v in states.items() if v == 1] == [state]
        assert sum(states.values()) == 1
        assert value(samples, "hal0d_slot_in_flight", slot=slot) == 0
        assert value(samples, "hal0d_slot_queued", slot=slot) == 0
        assert value(samples, "hal0d_upstream_process_restarts_total", slot=slot) == 0


async def test_metrics_slot_gauges_show_a_held_request_and_a_queued_one(
    upstream_app, start_hal0d, http
):
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(ROLE_CHUNK + content_chunk("hi"))
        await release.wait()
        await response.write(FINISH_CHUNK + DONE)
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": held})
    hal0d = await start_hal0d(url, slot={"max_concurrent": 1})

    async def client() -> bytes:
        async with http.post(hal0d.make_url(CHAT), json=chat_body()) as resp:
            return await resp.read()

    tasks = [asyncio.create_task(client())]
    async def slot_has(key: str) -> bool:
        return bool((await get_json(http, hal0d, "/api/slots"))["slots"][0][key] >= 1)

    await eventually(lambda: slot_has("in_flight"), 1.0, "the first request in flight")
    tasks.append(asyncio.create_task(client()))
    await eventually(lambda: slot_has("queued"), 1.0, "the second request queued")
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_in_flight", slot="llm") == 1
    assert value(samples, "hal0d_slot_queued", slot="llm") == 1
    assert value(samples, "hal0d_slot_state", slot="llm", state="serving") == 1
    assert value(samples, "hal0d_slot_state", slot="llm", state="ready") == 0
    release.set()
    assert all(body.endswith(DONE) for body in await asyncio.gather(*tasks))
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_in_flight", slot="llm") == 0
    assert value(samples, "hal0d_slot_state", slot="llm", state="ready") == 1


async def test_metrics_endpoint_labels_do_not_grow_with_unknown_paths(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url(CHAT), json=chat_body(stream=False)) as resp:
        assert resp.status == 200
    for index in range(3):
        async with http.post(hal0d.make_url(f"/v1/no-such-endpoint-{index}"), json={}) as resp:
            assert resp.status == 404
    samples = await scrape(http, hal0d)
    endpoints = {s.labels["endpoint"] for s in samples["hal0d_requests_total"]}
    # A client must not be able to mint a new time series per path it makes up.
    assert not any("no-such-endpoint" in endpoint for endpoint in endpoints), endpoints


# -- the model lifecycle -----------------------------------------------------------------------


async def test_metrics_count_loads_failed_loads_idle_unloads_and_evictions(
    start_hal0d, http, tmp_path
):
    """On-demand slots with the real stub as their command: each load, failed load, eviction and
    idle unload is counted, and the loaded gauge and the group's memory follow the slots."""
    group = {"gpu0": GroupConfig("gpu0", max_loaded=1, memory_mib=8192)}
    config = build_config(
        tmp_path,
        on_demand("a", tmp_path, group="gpu0", memory_mib=4096),
        on_demand("b", tmp_path, group="gpu0", memory_mib=3072),
        on_demand("c", tmp_path, models=("reasoning",), idle_unload_s=0.3),
        dataclasses.replace(on_demand("c", tmp_path, "--fail-start", "error: no such model file",
                                      models=("tool",)), name="f"),
        groups=group,
    )
    hal0d = await start_hal0d("http://unused", config=config)
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loaded", slot="a") == 0
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 0

    assert (await lifecycle_chat(http, hal0d, "chat"))[0] == 200
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loads_total", slot="a", outcome="ok") == 1
    assert value(samples, "hal0d_slot_load_seconds_count", slot="a") == 1
    assert 0 < (value(samples, "hal0d_slot_load_seconds_sum", slot="a") or 0) < STARTUP_S
    assert value(samples, "hal0d_slot_loaded", slot="a") == 1
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 4096

    assert (await lifecycle_chat(http, hal0d, "think-only"))[0] == 200  # evicts a
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_unloads_total", slot="a", reason="evicted") == 1
    assert value(samples, "hal0d_slot_loaded", slot="a") == 0
    assert value(samples, "hal0d_slot_loaded", slot="b") == 1
    assert value(samples, "hal0d_group_memory_mib", group="gpu0") == 3072

    status, answer = await lifecycle_chat(http, hal0d, "tool")
    assert status == 503 and answer["error"]["code"] == "slot.load_failed"
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_slot_loads_total", slot="f", outcome="failed") == 1
    assert value(samples, "hal0d_slot_loads_total", slot="f", outcome="ok") is None
    assert value(samples, "hal0d_slot_load_seconds_count", slot="f") == 1
    assert value(samples, "hal0d_slot_loaded", slot="f") == 0

    assert (await lifecycle_chat(http, hal0d, "reasoning"))[0] == 200

    async def idle_unloaded() -> dict[str, list[Sample]]:
        samples = await scrape(http, hal0d)
        assert value(samples, "hal0d_slot_unloads_total", slot="c", reason="idle") == 1
        return samples

    samples = await eventually(idle_unloaded, 5.0, "c unloaded as idle")
    assert value(samples, "hal0d_slot_loaded", slot="c") == 0
    assert value(samples, "hal0d_slot_loads_total", slot="c", outcome="ok") == 1
    assert value(samples, "hal0d_slot_unloads_total", slot="b", reason="evicted") is None
    assert value(samples, "hal0d_slot_loaded", slot="b") == 1


async def test_made_up_response_ids_add_no_metrics_lines(
    stub: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """Endpoint labels are route templates: 200 requests for made-up /v1/responses ids leave
    /metrics as long as it was after the first few."""
    hal0d = await start_hal0d(stub.url)

    async def ask_made_up(count: int, start: int) -> None:
        for n in range(start, start + count):
            async with http.get(hal0d.make_url(f"/v1/responses/resp_made_up_{n}")) as resp:
                assert resp.status == 404

    async def metrics_lines() -> list[str]:
        async with http.get(hal0d.make_url("/metrics")) as resp:
            return [line for line in (await resp.text()).splitlines()
                    if not line.startswith("#")]

    await ask_made_up(3, 0)
    before = await metrics_lines()
    await ask_made_up(200, 3)
    after = await metrics_lines()
    assert len(after) == len(before)
    assert any('endpoint="/v1/responses/{id}"' in line for line in after)
    assert not any("resp_made_up" in line for line in after)


async def test_a_stream_without_usage_counts_its_generated_deltas_not_the_closing_one(
    stub: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """The seed's count: one per `"delta":` that carries generated output; the role-only
    opening chunk and the finish chunk's empty delta are none."""
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json={"model": "chat", "stream": True,
                               "messages": [{"role": "user", "content": "hi"}]}) as resp:
        raw = await resp.read()
    generated = 0
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            delta = orjson.loads(line[len("data: "):])["choices"][0].get("delta") or {}
            generated += bool(delta.get("content") or delta.get("reasoning_content"))
    assert generated > 1
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        [row] = (await resp.json())["requests"]
    assert row["completion_tokens"] == generated, (row, generated)
