"""llama-server's own /v1/responses through hal0d's default (`responses = "native"`), read by the
official openai SDK over real sockets.

llama-server's stream (tests/fixtures/llama-server/responses-stream.sse, captured) names its events
and their items but carries no `sequence_number`, `output_index` or `content_index`, and the SDK's
`responses.stream()` indexes its output by them: without them it raises `TypeError: list indices
must be integers or slices, not NoneType`. The native relay supplies them from the items it has
seen; a stream that carries them (vLLM's, OpenAI's) passes through byte for byte.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.openai.responses import ResponsesTransform
from hal0d.protocol.transform import StallTrip
from tests.fixtures_util import fixture_path

if TYPE_CHECKING:
    from openai import AsyncOpenAI

STREAM = fixture_path("llama-server/responses-stream.sse").read_bytes()
WHOLE = fixture_path("llama-server/responses-whole.json").read_bytes()
STREAM_TEXT = "What brings you here today?"  # what the captured stream generated
WHOLE_TEXT = "Nice to meet you! How can I assist you today"
PING = b":\n\n"  # llama-server's keepalive while it reads a prompt (--sse-ping-interval)
TRIP = StallTrip(reason="idle", elapsed_s=1.2, upstream="llm", total_s=30.0, idle_s=0.5)


def frames(body: bytes) -> list[bytes]:
    """The stream's events, each with its closing blank line, as llama-server writes them."""
    return [frame + b"\n\n" for frame in body.split(b"\n\n") if frame]


def payloads(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in body.split(b"\n") if line.startswith(b"data: ")]


def vllm_event(kind: str, sequence: int, **fields: Any) -> bytes:
    # vLLM's shape: pydantic's model_dump_json of the openai types, every field, compact.
    payload = {**fields, "sequence_number": sequence, "type": kind}
    return f"event: {kind}\ndata: ".encode() + orjson.dumps(payload) + b"\n\n"


def vllm_stream() -> bytes:
    response = {"id": "resp_v1", "object": "response", "created_at": 1, "model": "chat",
                "status": "in_progress", "output": [], "parallel_tool_calls": True,
                "tool_choice": "auto", "tools": []}
    item = {"id": "msg_v1", "type": "message", "role": "assistant", "status": "in_progress",
            "content": []}
    part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    text = "Hi there"
    done_part = {**part, "text": text}
    done_item = {**item, "status": "completed", "content": [done_part]}
    events = [
        ("response.created", {"response": response}),
        ("response.in_progress", {"response": response}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {"item_id": "msg_v1", "output_index": 0,
                                         "content_index": 0, "part": part}),
        *(("response.output_text.delta", {"item_id": "msg_v1", "output_index": 0,
                                          "content_index": 0, "delta": word, "logprobs": []})
          for word in ("Hi", " there")),
        ("response.output_text.done", {"item_id": "msg_v1", "output_index": 0,
                                       "content_index": 0, "text": text, "logprobs": []}),
        ("response.content_part.done", {"item_id": "msg_v1", "output_index": 0,
                                        "content_index": 0, "part": done_part}),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        ("response.completed", {"response": {
            **response, "status": "completed", "output": [done_item],
            "usage": {"input_tokens": 3, "output_tokens": 2, "total_tokens": 5,
                      "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens_details": {"reasoning_tokens": 0}}}}),
    ]
    return b"".join(vllm_event(kind, n, **fields) for n, (kind, fields) in enumerate(events))


def pieces(body: bytes, size: int | None) -> Iterator[bytes]:
    """`body` in reads of `size` bytes, or as llama-server writes it (one event a write)."""
    if size is None:
        yield from frames(body)
    else:
        yield from (body[at:at + size] for at in range(0, len(body), size))


async def replaying(upstream_app: Any, start_hal0d: Any, stream: bytes, *,
                    size: int | None = None) -> TestServer:
    """An upstream on a real port that answers /v1/responses with `stream` (or, not streamed,
    llama-server's whole answer) and a default hal0d in front of it."""

    async def responses(request: web.Request) -> web.StreamResponse:
        if not (await request.json()).get("stream"):
            return web.Response(body=WHOLE, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                               "Server": "llama.cpp"})
        await response.prepare(request)
        for piece in pieces(stream, size):
            await response.write(piece)
        return response

    upstream = await upstream_app({"POST /v1/responses": responses})
    return await start_hal0d(upstream, models=("chat",))


def sdk(server: TestServer) -> AsyncOpenAI:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0,
                       timeout=10.0)


@pytest.mark.parametrize("size", [None, 7, 1000])
async def test_the_sdks_stream_helper_reads_llama_servers_own_stream_by_default(
    upstream_app: Any, start_hal0d: Any, size: int | None
) -> None:
    hal0d = await replaying(upstream_app, start_hal0d, STREAM, size=size)
    async with sdk(hal0d) as client, client.responses.stream(
            model="chat", input="Say hello.") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == STREAM_TEXT
    assert final.output_text == STREAM_TEXT
    assert final.id == "resp_xI5OzNzpkVR8zbFwvVMLmkFlqg2G9qP6"  # llama-server's own
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert {(e.output_index, e.content_index) for e in deltas} == {(0, 0)}
    assert events[-1].type == "response.completed"


async def test_the_sdks_create_reads_llama_servers_stream_and_whole_answer(
    upstream_app: Any, start_hal0d: Any
) -> None:
    hal0d = await replaying(upstream_app, start_hal0d, STREAM)
    async with sdk(hal0d) as client:
        streamed = await client.responses.create(model="chat", input="Say hello.", stream=True)
        events = [event async for event in streamed]
        whole = await client.responses.create(model="chat", input="Say hello.")
    assert "".join(getattr(e, "delta", "") for e in events
                   if e.type == "response.output_text.delta") == STREAM_TEXT
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.output_index == 0 and added.item.id.startswith("msg_")
    assert whole.output_text == WHOLE_TEXT
    assert whole.usage is not None and whole.usage.output_tokens == 12


async def test_llama_servers_prefill_pings_go_out_as_they_came(
    upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await replaying(upstream_app, start_hal0d, PING * 3 + STREAM)
    async with http.post(hal0d.make_url("/v1/responses"),
                         json={"model": "chat", "input": "hi", "stream": True}) as answer:
        body = await answer.read()
    assert body.startswith(PING * 3)
    events = payloads(body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events] == [e["type"] for e in payloads(STREAM)]


async def test_a_stream_that_carries_the_fields_passes_through_byte_for_byte(
    upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    recorded = vllm_stream()
    hal0d = await replaying(upstream_app, start_hal0d, recorded, size=97)
    async with http.post(hal0d.make_url("/v1/responses"),
                         json={"model": "chat", "input": "hi", "stream": True}) as answer:
        through = await answer.read()
    assert through == recorded
    async with sdk(hal0d) as client, client.responses.stream(model="chat", input="hi") as stream:
        final = await stream.get_final_response()
    assert final.output_text == "Hi there"


# The transform alone, as a playbook: llama-server's bytes in, the events with their fields out.

def fed(transform: ResponsesTransform, body: bytes, cuts: list[int]) -> bytes:
    edges = [0, *sorted(set(cuts)), len(body)]
    return b"".join(transform.feed(body[a:b]) for a, b in itertools.pairwise(edges))


def test_the_fields_supplied_are_the_items_index_and_the_parts() -> None:
    out = payloads(fed(ResponsesTransform(model="chat"), STREAM, []))
    given = payloads(STREAM)
    assert [e["sequence_number"] for e in out] == list(range(len(given)))
    for before, after in zip(given, out, strict=True):
        # What llama-server sent stays as it sent it; hal0d only adds.
        assert {k: after[k] for k in before if k not in ("response", "part")} == {
            k: v for k, v in before.items() if k not in ("response", "part")}
        if "response" in before:
            assert before["response"].items() <= after["response"].items()
        if before["type"] not in ("response.created", "response.in_progress",
                                  "response.completed"):
            assert after["output_index"] == 0
    by_type = {e["type"]: e for e in out}
    assert by_type["response.content_part.added"]["content_index"] == 0
    assert by_type["response.output_text.done"]["content_index"] == 0
    assert by_type["response.output_text.delta"]["logprobs"] == []
    assert by_type["response.content_part.added"]["part"]["annotations"] == []
    created = by_type["response.created"]["response"]
    assert created["model"] == "chat" and created["output"] == []


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=len(STREAM) - 1), max_size=12))
def test_any_split_of_llama_servers_stream_gives_the_same_events(cuts: list[int]) -> None:
    whole = payloads(fed(ResponsesTransform(model="chat"), STREAM, []))
    split = payloads(fed(ResponsesTransform(model="chat"), STREAM, cuts))
    for event in whole + split:  # the one field hal0d makes up that may differ run to run
        if event["type"] in ("response.created", "response.in_progress"):
            event["response"].pop("created_at", None)
    assert split == whole


def test_a_reasoning_item_and_a_function_call_get_their_own_output_index() -> None:
    # The shapes llama-server's sources (tools/server/server-task.cpp) emit for a thinking model
    # that calls a tool: the reasoning item is open while the text streams, all items end last.
    def event(kind: str, **fields: Any) -> bytes:
        return f"event: {kind}\ndata: ".encode() + orjson.dumps({"type": kind, **fields}) + (
            b"\n\n")

    body = b"".join([
        event("response.created", response={"id": "resp_r", "object": "response"}),
        event("response.output_item.added", item={"id": "rs_1", "type": "reasoning",
                                                   "content": [], "summary": []}),
        event("response.reasoning_text.delta", item_id="rs_1", delta="hm"),
        event("response.output_item.added", item={"id": "msg_1", "type": "message",
                                                   "content": [], "role": "assistant"}),
        event("response.content_part.added", item_id="msg_1",
              part={"type": "output_text", "text": ""}),
        event("response.output_text.delta", item_id="msg_1", delta="ok"),
        event("response.output_item.added", item={"id": "fc_1", "type": "function_call",
                                                   "call_id": "call_1", "name": "f",
                                                   "arguments": ""}),
        event("response.function_call_arguments.delta", item_id="fc_1", delta="{}"),
        event("response.output_item.done", item={"id": "rs_1", "type": "reasoning"}),
        event("response.output_text.done", item_id="msg_1", text="ok"),
        event("response.output_item.done", item={"id": "msg_1", "type": "message"}),
        event("response.output_item.done", item={"id": "fc_1", "type": "function_call"}),
    ])
    out = payloads(ResponsesTransform(model="m").feed(body))
    assert [(e["type"].removeprefix("response."), e.get("output_index"), e.get("content_index"))
            for e in out] == [
        ("created", None, None),
        ("output_item.added", 0, None),
        ("reasoning_text.delta", 0, 0),
        ("output_item.added", 1, None),
        ("content_part.added", 1, 0),
        ("output_text.delta", 1, 0),
        ("output_item.added", 2, None),
        ("function_call_arguments.delta", 2, None),
        ("output_item.done", 0, None),
        ("output_text.done", 1, 0),
        ("output_item.done", 1, None),
        ("output_item.done", 2, None),
    ]


def test_a_stall_in_llama_servers_stream_continues_its_numbering_and_its_item() -> None:
    transform = ResponsesTransform(model="chat")
    opening = b"".join(frames(STREAM)[:6])  # up to the second text delta
    numbered = payloads(transform.feed(opening))
    ending = payloads(transform.stalled(TRIP))
    assert [e["sequence_number"] for e in numbered + ending] == list(range(len(numbered) + 2))
    assert [e["type"] for e in ending] == ["response.output_text.delta", "response.incomplete"]
    assert ending[0]["item_id"] == numbered[2]["item"]["id"]
    assert (ending[0]["output_index"], ending[0]["content_index"]) == (0, 0)
    assert ending[1]["response"]["id"] == numbered[0]["response"]["id"]
