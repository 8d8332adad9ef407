"""The Anthropic Messages surface over real sockets: raw HTTP, and an independent SSE client.

hal0d listens on a loopback port in front of the stub upstream or a purpose-built one
(`upstream_app`). Streams are read twice over: byte for byte (our strict reader in
tests/anthropic_rules.py) and with aiohttp-sse-client, a decoder we did not write, so our own
decoder is not the only judge of our own output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from aiohttp_sse_client import client as sse_client

from hal0d.config import ServerConfig
from hal0d_stub.app import CONTENT_TEXT, REASONING_TEXT, prompt_tokens, words
from tests.anthropic_rules import Event, assemble, assert_valid_anthropic_stream, events_from_sse
from tests.harness.config import make_config
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

MESSAGES = "/llm/v1/messages"
UpstreamApp = Callable[[dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]],
                       Awaitable[str]]


def body(model: str = "reasoning", *, stream: bool = True, content: str = "hi",
         max_tokens: int = 64, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


# --- reading streams -----------------------------------------------------------------------


class _StreamEnded(Exception):
    """aiohttp-sse-client calls on_error when the body ends (then it would reconnect)."""


def _ended() -> None:
    raise _StreamEnded


async def read_independently(
    http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> list[tuple[float, str, dict[str, Any]]]:
    """(seconds since the request, event name, parsed data) per event, read by aiohttp-sse-client
    to the end of the body. It refuses a response that is not 200 text/event-stream."""
    started = time.monotonic()
    out: list[tuple[float, str, dict[str, Any]]] = []
    source = sse_client.EventSource(
        str(url), option={"method": "POST"}, session=http, json=payload,
        headers=dict(headers or {}), on_error=_ended, max_connect_retry=0,
    )
    async with asyncio.timeout(15):
        try:
            async with source:
                async for message in source:
                    assert message.type, f"a frame without an event name: {message!r}"
                    assert message.type == message.message
                    out.append((time.monotonic() - started, message.type, json.loads(message.data)))
        except _StreamEnded:
            pass
    assert out, "the independent SSE client saw no events"
    return out


async def independent_events(http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
                             headers: dict[str, str] | None = None) -> list[Event]:
    return [(name, data) for _, name, data in await read_independently(http, url, payload, headers)]


def check_wire(raw: bytes) -> list[Event]:
    """Our strict reading of the bytes, plus what the wire itself must look like."""
    assert b"[DONE]" not in raw
    events = events_from_sse(raw)  # every frame is exactly an event: line and a data: line
    for frame in raw[:-2].split(b"\n\n"):
        data = frame.split(b"\n")[1][len(b"data: "):]
        compact = json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False)
        assert data == compact.encode(), f"data is not compact JSON: {data!r}"
    return events


async def post_stream(
    http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.post(url, json=payload, headers=headers) as resp:
        return resp, await resp.read()


def names(events: list[Event]) -> list[str]:
    return [name for name, _ in events]


def collapsed(events: list[Event]) -> list[str]:
    """Event names with runs of content_block_delta folded into one `delta...` entry, and the
    block type and index on each content_block_start / content_block_stop."""
    out: list[str] = []
    for name, data in events:
        if name == "content_block_delta":
            if out[-1] != "delta...":
                out.append("delta...")
        elif name == "content_block_start":
            out.append(f"start {data['content_block']['type']} {data['index']}")
        elif name == "content_block_stop":
            out.append(f"stop {data['index']}")
        else:
            out.append(name)
    return out


def whole_prompt(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage with its prompt as one count: the same request asked again reads the part of its
    prompt the upstream's cache holds from there (cache_read_input_tokens), not as input_tokens."""
    out = dict(usage)
    out["input_tokens"] += out.pop("cache_read_input_tokens", 0)
    return out


def without_ids(events: list[Event]) -> list[Event]:
    """The events without what differs between two asks of the same: the message's id, and how
    much of the prompt the upstream's cache held."""
    out = []
    for name, data in events:
        if name == "message_start":
            out.append((name, {**data, "message": {**data["message"], "id": "msg_"}}))
        elif name == "message_delta":
            out.append((name, {**data, "usage": whole_prompt(data["usage"])}))
        else:
            out.append((name, data))
    return out


async def error_body(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    assert resp.content_type == "application/json", resp.content_type
    parsed = await resp.json()
    assert set(parsed) == {"type", "error"} and parsed["type"] == "error", parsed
    assert set(parsed["error"]) >= {"type", "message"}, parsed
    return parsed["error"]


# --- upstreams -----------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {
        "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def scripted(pieces: list[bytes | float], seen: list[dict[str, Any]] | None = None,
             ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that writes `pieces` in order; a float is a pause of that many seconds.
    It ends the body cleanly after the last piece, whatever the pieces said."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(await request.json())
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                await response.write(piece)
        await response.write_eof()
        return response

    return handler


ROLE = chunk({"role": "assistant", "content": None})
COMPLETE = [ROLE, chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk(finish="stop"),
            b"data: [DONE]\n\n"]


@pytest.fixture
async def hal0d(stub: Stub, start_hal0d: Any) -> TestServer:
    return await start_hal0d(stub.url, aliases={"claude-*": "reasoning"})


# --- the shape of a stream -----------------------------------------------------------------


async def test_reasoning_stream_order_thinking_index0_closed_before_text_index1(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    url = hal0d.make_url(MESSAGES)
    seen = await independent_events(http, url, body("reasoning"))
    expected = ["message_start", "start thinking 0", "delta...", "stop 0",
                "start text 1", "delta...", "stop 1", "message_delta", "message_stop"]
    assert collapsed(seen) == expected
    kinds = {(d["index"], d["delta"]["type"]) for n, d in seen if n == "content_block_delta"}
    assert kinds == {(0, "thinking_delta"), (1, "text_delta")}
    message = assemble(seen)
    assert message["content"][0]["thinking"] == REASONING_TEXT
    assert message["content"][1]["text"] == CONTENT_TEXT
    assert message["stop_reason"] == "end_turn"

    resp, raw = await post_stream(http, url, body("reasoning"))
    assert resp.status == 200
    assert resp.headers[hdrs.CONTENT_TYPE].split(";")[0] == "text/event-stream"
    assert resp.headers[hdrs.CACHE_CONTROL] == "no-cache"
    wire = check_wire(raw)
    assert assert_valid_anthropic_stream(wire) == "success"
    assert without_ids(wire) == without_ids(seen)  # both decoders read the same stream


async def test_chat_only_stream_puts_text_at_index_0_with_no_thinking_block(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("chat"))
    assert collapsed(seen) == ["message_start", "start text 0", "delta...", "stop 0",
                               "message_delta", "message_stop"]
    assert assemble(seen)["content"] == [{"type": "text", "text": CONTENT_TEXT}]


async def test_think_only_stream_closes_its_block_before_message_delta(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("think-only"))
    assert collapsed(seen) == ["message_start", "start thinking 0", "delta...", "stop 0",
                               "message_delta", "message_stop"]
    assert assemble(seen)["content"][0]["thinking"] == REASONING_TEXT
    assert assert_valid_anthropic_stream(seen) == "success"


async def test_tool_call_stream_is_a_tool_use_block_of_input_json_deltas(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    seen = await independent_events(
        http, hal0d.make_url(MESSAGES), body("tool", tools=tools)
    )
    assert collapsed(seen) == ["message_start", "start tool_use 0", "delta...", "stop 0",
                               "message_delta", "message_stop"]
    start = seen[1][1]["content_block"]
    assert start["name"] == "get_weather" and start["input"] == {} and start["id"]
    fragments = [d["delta"]["partial_json"] for n, d in seen if n == "content_block_delta"]
    assert len(fragments) > 1  # streamed as they came, not gathered
    message = assemble(seen)
    assert message["content"][0]["input"] == {"query": "weather in Paris"}
    assert message["stop_reason"] == "tool_use"


async def test_every_frame_has_event_and_compact_data_lines_message_stop_once_and_no_done(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    for model in ("reasoning", "chat", "think-only", "tool"):
        resp, raw = await post_stream(http, hal0d.make_url(MESSAGES), body(model))
        assert resp.status == 200, model
        events = check_wire(raw)
        assert raw.count(b"event: message_stop\n") == 1, model
        assert names(events)[-1] == "message_stop", model
        assert names(events).count("message_start") == 1
        assert b'"index":0' in raw  # the compact form the seed's grep relies on


async def test_message_start_envelope_echoes_the_client_model_through_an_alias(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("claude-sonnet-4"))
    name, start = seen[0]
    assert name == "message_start"
    message = start["message"]
    assert message["id"].startswith("msg_") and len(message["id"]) > len("msg_")
    assert message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == "claude-sonnet-4"
    assert message["content"] == [] and message["stop_reason"] is None
    assert message["usage"]["input_tokens"] > 0
    assert assemble(seen)["content"][0]["thinking"] == REASONING_TEXT  # reached "reasoning"
    other = await independent_events(http, hal0d.make_url(MESSAGES), body("claude-sonnet-4"))
    assert other[0][1]["message"]["id"] != message["id"]


async def test_beta_query_and_anthropic_headers_and_x_api_key_are_accepted(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    headers = {
        "x-api-key": "sk-ant-anything",
        "anthropic-version": "2023-06-01",
        "anthropic-beta": "interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14",
    }
    for url in (hal0d.make_url(MESSAGES).with_query(beta="true"),
                hal0d.make_url("/v1/messages").with_query(beta="true")):
        seen = await independent_events(http, url, body("chat"), headers)
        assert assemble(seen)["content"][0]["text"] == CONTENT_TEXT
        async with http.post(url, json=body("chat", stream=False), headers={
            **headers, "Authorization": "Bearer sk-ant-anything"
        }) as resp:
            assert resp.status == 200
            assert (await resp.json())["content"][0]["text"] == CONTENT_TEXT


async def test_access_keys_accept_x_api_key_and_bearer_and_refuse_others_with_401(
    stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession, tmp_path: Any
) -> None:
    config = make_config(stub.url, tmp_path=tmp_path)
    config = dataclasses.replace(config, server=ServerConfig(
        api_keys=("sk-local",), accepted_keys=frozenset({"sk-local"})))
    hal0d = await start_hal0d(stub.url, config=config)
    url = hal0d.make_url(MESSAGES).with_query(beta="true")
    for good in ({"x-api-key": "sk-local", "anthropic-version": "2023-06-01"},
                 {"Authorization": "Bearer sk-local"}):
        seen = await independent_events(http, url, body("chat"), good)
        assert assemble(seen)["content"][0]["text"] == CONTENT_TEXT, good
    for bad in ({"x-api-key": "sk-wrong"}, {}, {"Authorization": "Bearer sk-wrong"}):
        for stream in (True, False):
            async with http.post(url, json=body("chat", stream=stream), headers=bad) as resp:
                assert resp.status == 401, bad
                error = await error_body(resp)
            assert error["type"] == "authentication_error"
    # only the two accepted requests reached the upstream
    assert sum(line.split()[1] == "start" for line in stub.lines()) == 2, stub.lines()


async def test_v1_messages_answers_exactly_like_llm_v1_messages(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    answers = {}
    for path in (MESSAGES, "/v1/messages"):
        url = hal0d.make_url(path)
        _, raw = await post_stream(http, url, body("reasoning"))
        streamed = without_ids(check_wire(raw))
        async with http.post(url, json=body("reasoning", stream=False)) as resp:
            whole = await resp.json()
            whole.pop("id")
            whole["usage"] = whole_prompt(whole["usage"])
        errors = []
        for bad in (body("gpt-9"), {"model": "chat", "messages": []}, body("chat", max_tokens=0)):
            async with http.post(url, json=bad) as resp:
                errors.append((resp.status, await resp.json()))
        async with http.post(f"{url}/count_tokens", json={
            "model": "chat", "messages": [{"role": "user", "content": "one two three"}]
        }) as resp:
            counted = (resp.status, await resp.json())
        answers[path] = (streamed, whole, errors, counted)
    assert answers[MESSAGES] == answers["/v1/messages"]
    streamed, whole, errors, counted = answers[MESSAGES]
    assert [s for s, _ in errors] == [404, 400, 400]
    assert counted == (200, {"input_tokens": prompt_tokens(
        {"messages": [{"role": "user", "content": "one two three"}]})})


async def test_non_streaming_answer_is_the_messages_json(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    for stream_field in ({"stream": False}, {}):
        payload = {k: v for k, v in body("claude-x").items() if k != "stream"} | stream_field
        async with http.post(hal0d.make_url(MESSAGES), json=payload) as resp:
            assert resp.status == 200
            assert resp.content_type == "application/json"
            message = await resp.json()
        assert message["id"].startswith("msg_")
        assert message["type"] == "message" and message["role"] == "assistant"
        assert message["model"] == "claude-x"
        assert message["content"] == [
            {"type": "thinking", "thinking": REASONING_TEXT, "signature": ""},
            {"type": "text", "text": CONTENT_TEXT},
        ]
        assert message["stop_reason"] == "end_turn" and message["stop_sequence"] is None
        assert message["usage"]["input_tokens"] > 0 and message["usage"]["output_tokens"] > 0


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
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession, status: int,
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
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession, same_read: bool,
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


# --- streaming behaviour -------------------------------------------------------------------


async def test_stream_is_unbuffered_first_delta_arrives_before_the_upstream_pause_ends(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    url = await upstream_app({"POST /v1/chat/completions": scripted(
        [ROLE, chunk({"content": "first"}), 1.0, chunk({"content": " second"}),
         chunk(finish="stop"), b"data: [DONE]\n\n"]
    )})
    hal0d = await start_hal0d(url, models=("chat",))
    timed = await read_independently(http, hal0d.make_url(MESSAGES), body("chat"))
    deltas = [(at, data["delta"]["text"]) for at, name, data in timed
              if name == "content_block_delta"]
    assert [text for _, text in deltas] == ["first", " second"]
    assert deltas[0][0] < 0.8, deltas
    assert deltas[1][0] >= 1.0, deltas
    assert timed[-1][1] == "message_stop"


async def slots_in_flight(http: aiohttp.ClientSession, hal0d: TestServer) -> int:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        return int((await resp.json())["slots"][0]["in_flight"])


async def test_client_disconnect_mid_stream_cancels_the_upstream_and_frees_the_slot(
    stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)  # "long" with this max_tokens streams for minutes
    source = sse_client.EventSource(
        str(hal0d.make_url(MESSAGES)), option={"method": "POST"}, session=http,
        json=body("reasoning", content="long", max_tokens=500_000), max_connect_retry=0,
    )
    async with source:
        async for message in source:
            if message.type == "content_block_delta":
                break
        assert await slots_in_flight(http, hal0d) == 1
        assert not any("cancelled" in line for line in stub.lines())
    gone = time.monotonic()

    def cancelled() -> bool:
        assert any("cancelled" in line for line in stub.lines()), stub.lines()
        return True

    async def released() -> bool:
        return await slots_in_flight(http, hal0d) == 0

    await eventually(cancelled, 1.0, "the stub's generation cancelled")
    await eventually(released, 1.0 - (time.monotonic() - gone), "the slot released")
    assert sum("cancelled" in line for line in stub.lines()) == 1
    assert not any(line.split()[1] == "end" for line in stub.lines())


async def test_slot_max_output_tokens_clamps_the_requested_max_tokens(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    sent: list[dict[str, Any]] = []
    url = await upstream_app({"POST /v1/chat/completions": scripted(COMPLETE, sent)})
    hal0d = await start_hal0d(url, models=("chat",), slot={"max_output_tokens": 5})
    for asked in (128_000, 3):
        seen = await independent_events(http, hal0d.make_url(MESSAGES),
                                        body("chat", max_tokens=asked))
        assert names(seen)[-1] == "message_stop"
    assert [s["max_tokens"] for s in sent] == [5, 3]
    assert all(s["stream"] is True and s["model"] == "chat" for s in sent)
    assert sent[0]["stream_options"]["include_usage"] is True


async def test_input_tokens_come_from_usage_on_the_first_chunk_and_repeat_in_message_delta(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    # vLLM with continuous_usage_stats: usage on every chunk, and one more after the finish.
    def usage(done: int) -> dict[str, int]:
        return {"prompt_tokens": 1234, "completion_tokens": done, "total_tokens": 1234 + done}

    url = await upstream_app({"POST /v1/chat/completions": scripted([
        chunk({"role": "assistant", "content": ""}, usage=usage(0)),
        chunk({"content": "Hel"}, usage=usage(1)),
        chunk({"content": "lo"}, usage=usage(2)),
        chunk(finish="stop", usage=usage(2)),
        b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [],
                                  "usage": usage(2)}) + b"\n\n",
        b"data: [DONE]\n\n",
    ])})  # no /tokenize here: hal0d's fallback would be a chars/4 estimate
    hal0d = await start_hal0d(url, models=("chat",))
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("chat"))
    assert collapsed(seen) == ["message_start", "start text 0", "delta...", "stop 0",
                               "message_delta", "message_stop"]
    assert seen[0][1]["message"]["usage"]["input_tokens"] == 1234
    final = seen[-2][1]
    assert final["usage"]["input_tokens"] == 1234
    assert final["usage"]["output_tokens"] == 2
    assert names(seen).count("message_delta") == 1


async def test_message_delta_goes_out_at_the_usage_chunk_without_waiting_for_done(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    url = await upstream_app({"POST /v1/chat/completions": scripted([
        ROLE, chunk({"content": "Hi"}), chunk(finish="stop"),
        b"data: " + orjson.dumps({"id": "x", "choices": [], "usage": {
            "prompt_tokens": 9, "completion_tokens": 1, "total_tokens": 10}}) + b"\n\n",
        1.0, b"data: [DONE]\n\n",
    ])})
    hal0d = await start_hal0d(url, models=("chat",))
    timed = await read_independently(http, hal0d.make_url(MESSAGES), body("chat"))
    assert [name for _, name, _ in timed][-2:] == ["message_delta", "message_stop"]
    assert timed[-1][0] < 0.8, timed  # not held back until the upstream's [DONE]
    assert timed[-2][2]["usage"] == {"input_tokens": 9, "output_tokens": 1}


async def test_vllm_reasoning_field_empty_tool_calls_and_matched_stop_sequence(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    final = b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [
        {"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "###"}]}) + b"\n\n"
    url = await upstream_app({"POST /v1/chat/completions": scripted([
        ROLE, chunk({"reasoning": "Think"}), chunk({"reasoning": "ing."}),
        chunk({"content": "Done", "tool_calls": []}), final, b"data: [DONE]\n\n",
    ])})
    hal0d = await start_hal0d(url, models=("chat",))
    seen = await independent_events(
        http, hal0d.make_url(MESSAGES), body("chat", stop_sequences=["###"])
    )
    assert collapsed(seen) == ["message_start", "start thinking 0", "delta...", "stop 0",
                               "start text 1", "delta...", "stop 1", "message_delta",
                               "message_stop"]
    message = assemble(seen)
    assert [b.get("thinking", b.get("text")) for b in message["content"]] == ["Thinking.", "Done"]
    assert message["stop_reason"] == "stop_sequence"
    assert message["stop_sequence"] == "###"


async def test_two_upstream_tool_calls_become_two_tool_use_blocks_one_after_the_other(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    def call(index: int, arguments: str, **opening: str) -> bytes:
        function = {"arguments": arguments} | ({"name": opening["name"]} if opening else {})
        piece = {"index": index, "function": function} | (
            {"id": opening["id"], "type": "function"} if opening else {})
        return chunk({"tool_calls": [piece]})

    url = await upstream_app({"POST /v1/chat/completions": scripted([
        ROLE, chunk({"content": "Two lookups."}),
        call(0, "", id="call_a", name="lookup"), call(0, '{"query":'), call(0, '"Paris"}'),
        call(1, '{"query":"Rome"}', id="call_b", name="lookup"),
        chunk(finish="tool_calls"), b"data: [DONE]\n\n",
    ])})
    hal0d = await start_hal0d(url, models=("tool",))
    seen = await independent_events(http, hal0d.make_url(MESSAGES), body("tool"))
    assert collapsed(seen) == ["message_start", "start text 0", "delta...", "stop 0",
                               "start tool_use 1", "delta...", "stop 1",
                               "start tool_use 2", "delta...", "stop 2",
                               "message_delta", "message_stop"]
    message = assemble(seen)
    assert [(b["id"], b["input"]) for b in message["content"][1:]] == [
        ("call_a", {"query": "Paris"}), ("call_b", {"query": "Rome"})]
    assert message["stop_reason"] == "tool_use"
    assert assert_valid_anthropic_stream(seen) == "success"


async def test_upstream_receives_the_translated_agent_request_under_the_served_name(
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    sent: list[dict[str, Any]] = []
    url = await upstream_app({"POST /v1/chat/completions": scripted(COMPLETE, sent)})
    hal0d = await start_hal0d(url, models=("served-model",), aliases={"claude-*": "served-model"},
                              slot={"max_output_tokens": 4096})
    request = {
        "model": "claude-opus-4-1", "max_tokens": 128_000, "stream": True,
        "system": [{"type": "text", "text": "You are terse.",
                    "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "lookup", "description": "Look up.",
                   "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}],
        "tool_choice": {"type": "any"},
        "metadata": {"user_id": "user-7"},
        "stop_sequences": ["</done>"], "temperature": 0.5, "top_p": 0.9, "top_k": 20,
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "messages": [
            {"role": "user", "content": "Find Paris."},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "hidden", "signature": "sig"},
                {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": {"q": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "48.8N 2.3E"}]},
                {"type": "text", "text": "And now?"}]},
        ],
    }
    seen = await independent_events(http, hal0d.make_url(MESSAGES), request,
                                     {"anthropic-version": "2023-06-01"})
    assert seen[0][1]["message"]["model"] == "claude-opus-4-1"
    assert names(seen)[-1] == "message_stop"
    upstream = sent[0]
    assert upstream["model"] == "served-model"
    assert upstream["max_tokens"] == 4096
    assert upstream["stream"] is True
    assert upstream["stop"] == ["</done>"] and upstream["user"] == "user-7"
    assert (upstream["temperature"], upstream["top_p"], upstream["top_k"]) == (0.5, 0.9, 20)
    assert upstream["tool_choice"] == "required"
    assert upstream["tools"] == [{"type": "function", "function": {
        "name": "lookup", "description": "Look up.",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}]
    assert upstream["messages"] == [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Find Paris."},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "toolu_1", "type": "function",
            "function": {"name": "lookup", "arguments": '{"q":"Paris"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "48.8N 2.3E"},
        {"role": "user", "content": "And now?"},
    ]


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
    upstream_app: UpstreamApp, start_hal0d: Any, http: aiohttp.ClientSession
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
