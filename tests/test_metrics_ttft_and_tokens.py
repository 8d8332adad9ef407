"""TTFT and token figures over real sockets, from the stream tap: the time to the first token
(not the role-only chunk, not the stall frame), the tokens a stream generated counted without a
usage chunk, the pace of a stream, FLM's figures of a whole answer, and the bounded samples, as
the history row, /api/slots/metrics and /metrics show them."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web

from hal0d.config import Config, MetricsConfig, SlotConfig
from tests.harness.client import CHAT, chat_body
from tests.harness.observe import api_row, headers, scrape, slot_metrics, value
from tests.harness.stubs import DONE, FINISH_CHUNK, ROLE_CHUNK, STUB_MODELS, content_chunk


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
