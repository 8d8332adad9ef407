"""The stall guard and the per-read timeout over real sockets: the read timeout bounds the wait
for the upstream's headers (and trips with reason `read` when both guard bounds are off), the
guard's clocks start once the headers arrive, and a guarded body is watched by the guard's bounds
alone."""

from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import hdrs, web

from tests.harness.client import chat_body
from tests.harness.stallguard import (
    EPSILON,
    SLACK,
    TRIPPED,
    assert_chat_frame,
    guard,
    receive,
    stall_frame,
    wait_for_stub_line,
)


async def test_with_both_bounds_off_the_per_read_timeout_trips_with_reason_read(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(
        stub.url, dispatcher=guard(total=0, idle=0, direct_read_timeout_s=0.5)
    )
    with structlog.testing.capture_logs() as logs:
        got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert got.status == 200
    assert 0.5 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.5 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "read")
    assert [e["reason"] for e in logs if e["event"] == TRIPPED] == ["read"]
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_per_read_timeout_is_off_while_the_guard_owns_the_stream(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(
        stub.url, dispatcher=guard(total=0, idle=0.6, direct_read_timeout_s=0.2)
    )
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert 0.6 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.6 + SLACK
    assert_chat_frame(stall_frame(got.raw), "idle")


async def test_guard_clocks_start_once_the_upstream_headers_arrive(
    upstream_app, start_hal0d, http
):
    events = [b'data: {"id":"x","choices":[{"delta":{"content":"%d"}}]}\n\n' % i
              for i in range(3)] + [b"data: [DONE]\n\n"]

    async def upstream(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.5)  # a slow prompt: no headers yet
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(0.1)  # an upstream that paces its tokens
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    # Counted from the request, 0.6 s would cut the stream; counted from the headers it fits.
    hal0d = await start_hal0d(url, dispatcher=guard(total=0.6, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    assert got.duration >= 0.8
    assert got.raw == b"".join(events)


async def test_header_wait_is_bounded_by_the_read_timeout_not_by_the_guard(
    upstream_app, start_hal0d, http
):
    async def upstream(request: web.Request) -> web.StreamResponse:
        await asyncio.Event().wait()  # never answers
        raise AssertionError

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    setup = {"pool_timeout_s": 0.05, "connect_timeout_s": 0.05, "write_timeout_s": 0.05}
    hal0d = await start_hal0d(
        url, dispatcher=guard(total=0.2, idle=0.1, direct_read_timeout_s=0.5, **setup)
    )
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=chat_body()) as resp:
        body = await resp.json()
    waited = time.monotonic() - started

    assert resp.status == 502
    assert body["error"]["code"] == "dispatch.upstream_unavailable"
    assert 0.5 <= waited <= 0.65 + SLACK


async def test_a_guarded_body_is_not_bound_by_the_header_wait_timeout(
    upstream_app, start_hal0d, http
):
    """The per-read timeout bounds the header wait only: once the headers are in, the guard's
    bounds alone watch the body (a token may take longer than a header wait may)."""
    events = [b'data: {"choices":[{"delta":{"content":"late"}}]}\n\n', b"data: [DONE]\n\n"]

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.8)  # past the header wait's 0.3 s, within the idle bound's 2 s
        for event in events:
            await response.write(event)
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=2.0, direct_read_timeout_s=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    assert got.raw == b"".join(events)  # whole, with no stall frame
    assert got.duration >= 0.8
