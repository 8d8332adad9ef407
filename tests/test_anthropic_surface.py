"""The Anthropic Messages surface over real sockets: the shape of a stream and of a whole answer,
the paths, headers and keys it takes.

hal0d listens on a loopback port in front of the stub upstream (the `hal0d` fixture of
tests/conftest.py: `claude-*` an alias of `reasoning`). Streams are read twice over: byte for byte
(our strict reader in tests/anthropic_rules.py) and with aiohttp-sse-client, a decoder we did not
write, so our own decoder is not the only judge of our own output. Its failures are tested in
test_anthropic_surface_errors.py, its streaming against purpose-built upstreams in
test_anthropic_surface_streaming.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp
from aiohttp import hdrs
from aiohttp.test_utils import TestServer

from hal0d.config import ServerConfig
from hal0d_stub.models import CONTENT_TEXT, REASONING_TEXT
from hal0d_stub.prompt import prompt_tokens
from tests.anthropic_rules import assemble, assert_valid_anthropic_stream
from tests.harness.anthropic_surface import (
    MESSAGES,
    body,
    check_wire,
    collapsed,
    error_body,
    names,
    post_stream,
    whole_prompt,
    without_ids,
)
from tests.harness.client import independent_events
from tests.harness.config import make_config
from tests.harness.stubs import Stub

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
