"""The Anthropic Messages surface's failures over real sockets: before message_start a real
status and Anthropic's error envelope (a bad body, an unknown model, a dead or refusing upstream,
a full queue, an answer that is no JSON), after it one error event, last, and no message_stop (a
reset, a stall, an end without a finish_reason, a malformed chunk).

hal0d listens in front of the stub (the `hal0d` fixture of tests/conftest.py) or a purpose-built
upstream (`upstream_app`); streams are read by aiohttp-sse-client, a decoder we did not write.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d_stub.models import CONTENT_TEXT, words
from tests.anthropic_rules import Event, assemble, assert_valid_anthropic_stream
from tests.harness.anthropic_surface import (
    MESSAGES,
    ROLE,
    body,
    check_wire,
    chunk,
    error_body,
    names,
    post_stream,
    scripted,
)
from tests.harness.client import independent_events, read_independently
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, Upstream

# --- failures before message_start: real statuses ----------------------------------------


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"model": "chat", "max_tokens": 8, "stream": True,
          "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]},
         "max_tokens"),
        ({"model": "chat", "max_tokens": 8, "stream": True, "messages": "hi"}, "messages"),
        ({"max_tokens": 8, "stream": True, "messages": [{"role": "user", "content": "hi"}]},
         "model"),
        ({"model": "chat", "max_tokens": 8, "stream": True,
          "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
         "messages.1.content"),
    ],
)
async def test_invalid_body_is_400_invalid_request_error_naming_the_field(
    hal0d: TestServer, http: aiohttp.ClientSession, stub: Stub, payload: dict[str, Any],
    field: str,
) -> None:
    async with http.post(hal0d.make_url(MESSAGES), json=payload) as resp:
        assert resp.status == 400
        error = await error_body(resp)
    assert error["type"] == "invalid_request_error"
    assert field in error["message"], error
    assert not any("endpoint=chat" in line for line in stub.lines())  # never reached upstream


async def test_unknown_model_is_404_not_found_error_before_any_stream(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    for stream in (True, False):
        async with http.post(hal0d.make_url(MESSAGES), json=body("gpt-9", stream=stream)) as resp:
            assert resp.status == 404
            error = await error_body(resp)
        assert error["type"] == "not_found_error"
        assert "gpt-9" in error["message"]


async def test_dead_upstream_is_502_api_error_before_any_stream(
    start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(f"http://127.0.0.1:{free_port()}",
                              dispatcher={"connect_timeout_s": 2.0})
    started = time.monotonic()
    async with http.post(hal0d.make_url(MESSAGES), json=body("chat")) as resp:
        assert resp.status == 502
        error = await error_body(resp)
    assert time.monotonic() - started < 4.0
    assert error["type"] == "api_error"
    assert "'llm'" in error["message"]


@pytest.mark.parametrize(
    ("status", "error_type"),
    [(429, "rate_limit_error"), (500, "api_error"), (503, "overloaded_error")],
)
async def test_upstream_error_status_is_mapped_and_keeps_the_upstream_message(
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession, status: int,
    error_type: str,
) -> None:
    said = f"upstream says no ({status}): KV cache exhausted"

    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": said, "type": "server_error"}},
                                 status=status)

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": refuse}),
                              models=("chat",))
    for stream in (True, False):
        async with http.post(hal0d.make_url(MESSAGES), json=body("chat", stream=stream)) as resp:
            assert resp.status == status, stream
            error = await error_body(resp)
        assert error["type"] == error_type
        assert said in error["message"]


async def test_full_slot_queue_is_429_rate_limit_error_before_any_stream(
    stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url, slot={"max_concurrent": 1, "max_queue": 0})
    url = hal0d.make_url(MESSAGES)
    first = await http.post(url, json=body("reasoning", content="long", max_tokens=500_000))
    try:
        assert first.status == 200
        await first.content.readline()  # the first stream holds the only place
        for stream in (True, False):
            async with http.post(url, json=body("chat", stream=stream)) as resp:
                assert resp.status == 429
                assert int(resp.headers["Retry-After"]) >= 1
                error = await error_body(resp)
            assert error["type"] == "rate_limit_error"
    finally:
        first.close()


async def test_upstream_answering_a_stream_with_invalid_json_or_html_is_502_api_error(
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    async def html(request: web.Request) -> web.Response:
        return web.Response(text="<html>proxy says hi</html>", content_type="text/html")

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": html}),
                              models=("chat",))
    for stream in (True, False):
        async with http.post(hal0d.make_url(MESSAGES), json=body("chat", stream=stream)) as resp:
            assert resp.status == 502, stream
            error = await error_body(resp)
        assert error["type"] == "api_error"
        assert "'llm'" in error["message"]


# --- failures after message_start: one error frame, last -----------------------------------


def assert_ends_with_one_error(events: list[Event]) -> dict[str, Any]:
    assert events[0][0] == "message_start"
    assert names(events).count("error") == 1 and events[-1][0] == "error", names(events)
    assert "message_delta" not in names(events) and "message_stop" not in names(events)
    assert assert_valid_anthropic_stream(events) == "error"
    return events[-1][1]["error"]


async def test_upstream_reset_mid_stream_ends_with_one_error_frame_and_no_message_stop(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("broken"))
    error = assert_ends_with_one_error(seen)
    assert error["type"] == "api_error"
    assert "content_block_delta" in names(seen)
    # the stub's 3 tokens before the cut, and nothing made up after them
    assert assemble(seen)["content"] == [{"type": "text", "text": "".join(words(CONTENT_TEXT)[:3])}]
    _, raw = await post_stream(http, hal0d.make_url(MESSAGES), body("broken"))
    assert raw.count(b"event: error\n") == 1
    assert check_wire(raw)[-1][0] == "error"


async def test_stall_guard_trip_ends_with_an_error_frame_carrying_x_hal0_stall(
    stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url, dispatcher={"stream_idle_timeout_s": 0.3})
    timed = await read_independently(http, hal0d.make_url(MESSAGES), body("stall"))
    seen = [(name, data) for _, name, data in timed]
    error = assert_ends_with_one_error(seen)
    assert "x_hal0_stall" in error["message"]
    assert '"reason":"idle"' in error["message"]
    silence = timed[-1][0] - timed[-2][0]
    assert 0.25 <= silence < 1.5, silence


async def test_upstream_eof_without_finish_reason_ends_with_an_error_frame(
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    url = await upstream_app({"POST /v1/chat/completions": scripted(
        [ROLE, chunk({"content": "Hello"}), chunk({"content": " there"})]
    )})
    hal0d = await start_hal0d(url, models=("chat",))
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("chat"))
    error = assert_ends_with_one_error(seen)
    assert error["type"] == "api_error"
    assert assemble(seen)["content"] == [{"type": "text", "text": "Hello there"}]


BAD_CHUNKS = {
    "not_json": (b'data: {"choices": [{"delta": \n\n', "JSON"),
    "not_utf8": (b'data: {"choices":[{"index":0,"delta":{"content":"\xff\xfe"}}]}\n\n', "UTF-8"),
}


@pytest.mark.parametrize("bad", sorted(BAD_CHUNKS))
@pytest.mark.parametrize("same_read", [False, True], ids=["own_read", "same_read_as_good_chunks"])
async def test_malformed_chunk_ends_with_an_error_frame_after_what_came_before(
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession, same_read: bool,
    bad: str,
) -> None:
    frame, named = BAD_CHUNKS[bad]
    good = [ROLE, chunk({"content": "Hello"})]
    rest = [frame, chunk({"content": " world"}), chunk(finish="stop"), b"data: [DONE]\n\n"]
    # One write lands in one upstream read: the good chunks and the bad one reach the
    # transform together, as they do whenever an upstream writes faster than hal0d reads.
    pieces: list[bytes | float] = [b"".join(good + rest)] if same_read else [*good, 0.1, *rest]
    url = await upstream_app({"POST /v1/chat/completions": scripted(pieces)})
    hal0d = await start_hal0d(url, models=("chat",))
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("chat"))
    error = assert_ends_with_one_error(seen)
    assert error["type"] == "api_error"
    assert named in error["message"]
    assert assemble(seen)["content"] == [{"type": "text", "text": "Hello"}]
