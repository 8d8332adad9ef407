"""The stall guard over real sockets: hal0d in front of upstreams that never finish, fall silent,
stall in the middle of a line, or stream audio. Bounds are fractions of a second; timings are
asserted as ranges measured on the client's side of the socket. Which bound watches the wait for
the headers and which the body is tested in test_stallguard_read_timeout.py, slow and stalled
clients in test_stallguard_clients.py."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import structlog
from aiohttp import hdrs, web

from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.stallguard import (
    EPSILON,
    NOTICE,
    SLACK,
    TRIPPED,
    assert_chat_frame,
    guard,
    llm_slot,
    receive,
    sse_data,
    stall_frame,
    wait_for_stub_line,
)


async def test_chatty_upstream_is_cut_at_the_total_bound_with_a_chat_frame_and_closed_upstream(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.6, idle=0))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chatty"))

    assert got.status == 200
    assert got.headers[hdrs.CONTENT_TYPE].startswith("text/event-stream")
    assert 0.6 <= got.duration <= 0.6 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "total")
    assert "stream_total_timeout_s = 0.6" in frame["choices"][0]["delta"]["content"]
    assert 0.6 <= frame["x_hal0_stall"]["elapsed_s"] <= 0.6 + SLACK
    # Everything before the frame is the upstream's own, never-finishing stream.
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    assert len(relayed) > 10
    assert all(chunk["id"] != "hal0-stall-guard" for chunk in relayed)
    assert all(chunk["choices"][0]["finish_reason"] is None for chunk in relayed)
    # The frame opens with a blank line and is the last thing before [DONE].
    assert got.raw.endswith(b"data: [DONE]\n\n")
    await wait_for_stub_line(stub, "cancelled", within=1.0)


@pytest.mark.parametrize("total", [0, 5.0], ids=["total-off", "total-large"])
async def test_silent_upstream_is_cut_at_the_idle_bound_with_reason_idle(
    stub, start_hal0d, http, total
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=total, idle=0.4))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert got.status == 200
    silence = got.ended - got.last_upstream_chunk_at()
    assert 0.4 - EPSILON <= silence <= 0.4 + SLACK
    assert 0.4 <= got.duration <= 0.4 + SLACK + 0.2
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "idle")
    assert "stream_idle_timeout_s = 0.4" in frame["choices"][0]["delta"]["content"]
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    contents = [c["choices"][0]["delta"].get("content") for c in relayed[1:]]
    assert len(contents) == 3 and all(contents)  # the stub's three tokens, then silence
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_silent_upstream_trips_the_total_bound_when_it_comes_before_the_idle_one(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.3, idle=0.6))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))

    assert 0.3 <= got.duration <= 0.3 + SLACK
    assert_chat_frame(stall_frame(got.raw), "total")


async def test_idle_bound_does_not_trip_while_chunks_come_faster_than_it(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=1.0, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chatty"))

    assert 1.0 <= got.duration <= 1.0 + SLACK
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "total")
    assert 1.0 <= frame["x_hal0_stall"]["elapsed_s"] <= 1.0 + SLACK


async def test_frame_after_a_half_written_data_line_parses_as_its_own_event_before_done(
    upstream_app, start_hal0d, http
):
    complete = b'data: {"id":"x","choices":[{"delta":{"role":"assistant"}}]}\n\n'
    half = b'data: {"id":"x","choices":[{"delta":{"content":"hel'

    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        await response.write(complete)
        await asyncio.sleep(0.02)  # upstream pacing: the half line comes as a read of its own
        await response.write(half)
        await asyncio.Event().wait()  # stalled in the middle of the line, socket open
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url, dispatcher=guard(total=0, idle=0.3))
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body())

    # The bytes before the frame are exactly the upstream's, the half line included.
    assert got.raw.startswith(complete + half)
    tail = got.raw[len(complete + half):]
    assert tail.startswith(b"\n\n")
    tail_events = sse_data(tail)
    assert len(tail_events) == 2 and tail_events[1] == "[DONE]"
    # A parser fed the whole stream sees the upstream's events, the frame, then [DONE].
    events = sse_data(got.raw)
    assert events[:2] == [complete[len(b"data: "):-2].decode(), half[len(b"data: "):].decode()]
    assert len(events) == 4
    frame = stall_frame(got.raw)
    assert_chat_frame(frame, "idle")
    assert orjson.loads(tail_events[0]) == frame


async def test_legacy_completions_stream_gets_a_text_completion_frame(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    body = {"model": "stall", "prompt": "hi", "stream": True}
    got = await receive(http, hal0d.make_url("/v1/completions"), body)

    assert got.status == 200
    assert 0.3 <= got.duration <= 0.3 + SLACK + 0.2
    relayed = [orjson.loads(data) for data in sse_data(got.raw)[:-2]]
    assert [chunk["object"] for chunk in relayed] == ["text_completion"] * 3
    frame = stall_frame(got.raw)
    assert frame["object"] == "text_completion"
    [choice] = frame["choices"]
    assert "delta" not in choice
    assert choice["text"].startswith(NOTICE) and "idle" in choice["text"]
    assert choice["finish_reason"] == "length"
    assert frame["x_hal0_stall"]["reason"] == "idle"
    assert frame["x_hal0_stall"]["upstream"] == "llm"
    assert "elapsed_s" in frame["x_hal0_stall"]


async def test_silent_audio_stream_is_cut_with_no_bytes_added(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    body = {"model": "stall", "input": "hello", "voice": "x"}
    got = await receive(http, hal0d.make_url("/v1/audio/speech"), body)

    assert got.status == 200
    assert got.headers[hdrs.CONTENT_TYPE] == "audio/wav"
    assert got.raw == b"".join(bytes([i % 256]) * 1024 for i in range(3))
    assert 0.3 - EPSILON <= got.ended - got.last_upstream_chunk_at() <= 0.3 + SLACK
    await wait_for_stub_line(stub, "cancelled", within=1.0)


async def test_chatty_audio_stream_is_cut_at_the_total_bound_with_no_bytes_added(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.01)
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0.4, idle=0))
    body = {"model": "chatty", "input": "hello", "voice": "x"}
    got = await receive(http, hal0d.make_url("/v1/audio/speech"), body)

    assert 0.4 <= got.duration <= 0.4 + SLACK
    raw = got.raw
    assert len(raw) >= 5 * 1024
    expected = b"".join(bytes([i % 256]) * 1024 for i in range(len(raw) // 1024 + 1))
    assert raw == expected[: len(raw)]  # a prefix of what the upstream sent, nothing injected
    await wait_for_stub_line(stub, "cancelled", within=1.0)


def relayed_deltas(raw: bytes) -> list[tuple[Any, Any]]:
    events = sse_data(raw)
    assert events[-1] == "[DONE]"
    chunks = [orjson.loads(data) for data in events[:-1]]
    assert all("x_hal0_stall" not in chunk and chunk["id"] != "hal0-stall-guard"
               for chunk in chunks)
    return [(c["choices"][0]["delta"], c["choices"][0]["finish_reason"]) for c in chunks]


async def test_long_slow_healthy_stream_is_relayed_untouched_with_bounds_off_or_generous(
    start_stub, start_hal0d, http
):
    stub = await start_stub(delay=0.05)
    disabled = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0))
    generous = await start_hal0d(stub.url, dispatcher=guard(total=3.0, idle=0.5))
    body = chat_body("reasoning", content="long", max_tokens=30)
    direct, *via = await asyncio.gather(
        receive(http, f"{stub.url}/v1/chat/completions", body),
        receive(http, disabled.make_url("/v1/chat/completions"), body),
        receive(http, generous.make_url("/v1/chat/completions"), body),
    )

    expected = relayed_deltas(direct.raw)
    assert expected[-1] == ({}, "length")
    for got in via:
        assert got.status == 200
        assert got.duration >= 1.4  # longer than every bound the other tests trip
        assert b"x_hal0_stall" not in got.raw and b"[hal0]" not in got.raw
        assert got.raw.endswith(b"data: [DONE]\n\n")
        assert relayed_deltas(got.raw) == expected
    assert sum(1 for line in stub.lines() if line.split()[1] == "end") == 3


async def test_each_trip_logs_one_line_with_reason_elapsed_and_upstream(
    stub, start_hal0d, http
):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    with structlog.testing.capture_logs() as logs:
        got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("stall"))
        await eventually(lambda: any(e["event"] == "request.done" for e in logs), 0.5,
                         "request.done logged")

    assert_chat_frame(stall_frame(got.raw), "idle")
    [tripped] = [e for e in logs if e["event"] == TRIPPED]
    assert {"reason", "elapsed_s", "upstream"} <= tripped.keys()
    assert tripped["reason"] == "idle"
    assert tripped["upstream"] == "llm"
    assert 0.3 <= tripped["elapsed_s"] <= 0.3 + SLACK
    assert tripped["log_level"] == "warning"
    [done] = [e for e in logs if e["event"] == "request.done"]
    assert done["ok"] is False
    assert done["error_code"] == "stream_stall_idle"


async def test_slot_is_released_after_a_trip(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url, dispatcher=guard(total=0, idle=0.3))
    async with http.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body("stall")
    ) as resp:
        await resp.content.readuntil(b"\n\n")  # the stream is flowing
        async with http.get(hal0d.make_url("/api/slots")) as during:
            assert llm_slot(await during.json())["in_flight"] == 1
        raw = await resp.read()
    assert b"x_hal0_stall" in raw

    async def released() -> dict[str, Any]:
        async with http.get(hal0d.make_url("/api/slots")) as after:
            slot = llm_slot(await after.json())
        assert slot["in_flight"] == 0, slot
        return slot

    slot = await eventually(released, 0.2, "the slot released after the trip")
    assert slot["queued"] == 0
    # The released slot serves the next request at once.
    got = await receive(http, hal0d.make_url("/v1/chat/completions"), chat_body("chat"))
    assert got.raw.endswith(b"data: [DONE]\n\n") and b"x_hal0_stall" not in got.raw
