"""The Anthropic Messages surface streaming over real sockets, in front of purpose-built
upstreams (`upstream_app`) and the stub: each event as it comes, a client that leaves, the usage
the upstream reports, vLLM's and llama.cpp's dialects, several tool calls, and the chat request
the upstream receives. Streams are read by aiohttp-sse-client, a decoder we did not write.
"""

from __future__ import annotations

import time
from typing import Any

import aiohttp
import orjson
from aiohttp.test_utils import TestServer
from aiohttp_sse_client import client as sse_client

from tests.anthropic_rules import assemble, assert_valid_anthropic_stream
from tests.harness.anthropic_surface import (
    COMPLETE,
    MESSAGES,
    ROLE,
    body,
    chunk,
    collapsed,
    names,
    scripted,
)
from tests.harness.client import independent_events, read_independently
from tests.harness.poll import eventually
from tests.harness.stubs import Stub, Upstream

# --- streaming behaviour -------------------------------------------------------------------


async def test_stream_is_unbuffered_first_delta_arrives_before_the_upstream_pause_ends(
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
    upstream_app: Upstream, start_hal0d: Any, http: aiohttp.ClientSession
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
