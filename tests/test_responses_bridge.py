"""The Responses bridge as playbooks: chat completion chunks in, Responses events out, and the
transform around it (BridgeTransform): any split of the upstream's bytes, a malformed or cut
stream, keepalives. The request's translation is tested in test_responses_bridge_request.py.

Events are written short (see `short`) so each case reads as the stream a client sees: the
event's type, then its output index, and what it carries (a delta, an item's type and status).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.errors import ErrorCode
from hal0d.openai.responses_bridge import Bridge, BridgeTransform, Event, MalformedChunk, State
from hal0d.openai.responses_request import ChatRequest
from hal0d.protocol.sse import Decoder
from hal0d.protocol.transform import StallTrip, TransformFailed
from tests.harness.responses_bridge import CUSTOM_TOOLS, request


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta or {},
                                        "finish_reason": finish}]}
    if usage is not None:
        out = {"object": "chat.completion.chunk", "choices": [], "usage": usage}
    return out


def text(piece: str) -> dict[str, Any]:
    return chunk({"content": piece})


def think(piece: str) -> dict[str, Any]:
    return chunk({"reasoning_content": piece})


def call(index: int, name: str | None = None, arguments: str = "",
         call_id: str | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"arguments": arguments}
    if name is not None:
        function["name"] = name
    piece: dict[str, Any] = {"index": index, "function": function}
    if call_id is not None:
        piece["id"] = call_id
    return chunk({"tool_calls": [piece]})


USAGE = {"prompt_tokens": 7, "completion_tokens": 3}


def short(event: Event) -> tuple[Any, ...]:
    kind, data = event
    name = kind.removeprefix("response.")
    if "delta" in data:
        return (name, data["output_index"], data["delta"])
    if "item" in data:
        item = data["item"]
        return (name, data["output_index"], item["type"], item.get("status"))
    if "response" in data:
        return (name, data["response"]["status"])
    return (name, data.get("output_index"))


def run(chunks: list[dict[str, Any]], req: ChatRequest | None = None,
        end: bool = True) -> tuple[Bridge, list[Event]]:
    bridge = Bridge(req or request(), "m")
    events: list[Event] = []
    for piece in chunks:
        events += bridge.feed(piece)
    if end:
        events += bridge.finish()
    return bridge, events


def test_text_playbook() -> None:
    bridge, events = run([chunk({"role": "assistant"}), text("Hel"), text("lo"),
                          chunk(finish="stop"), chunk(usage=USAGE)])
    assert [short(e) for e in events] == [
        ("created", "in_progress"),
        ("in_progress", "in_progress"),
        ("output_item.added", 0, "message", "in_progress"),
        ("content_part.added", 0),
        ("output_text.delta", 0, "Hel"),
        ("output_text.delta", 0, "lo"),
        ("output_text.done", 0),
        ("content_part.done", 0),
        ("output_item.done", 0, "message", "completed"),
        ("completed", "completed"),
    ]
    final = events[-1][1]["response"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["input_tokens"] == 7 and final["usage"]["output_tokens"] == 3
    assert [e[1]["sequence_number"] for e in events] == list(range(len(events)))
    assert bridge.state is State.DONE


def test_reasoning_then_text_then_a_call_playbook() -> None:
    _, events = run([think("hmm"), text("Let me look."), call(0, "lookup", '{"q"', "call_1"),
                     call(0, arguments=': "x"}'), chunk(finish="tool_calls")])
    assert [short(e) for e in events][2:] == [
        ("output_item.added", 0, "reasoning", "in_progress"),
        ("content_part.added", 0),
        ("reasoning_text.delta", 0, "hmm"),
        ("reasoning_text.done", 0),
        ("content_part.done", 0),
        ("output_item.done", 0, "reasoning", "completed"),
        ("output_item.added", 1, "message", "in_progress"),
        ("content_part.added", 1),
        ("output_text.delta", 1, "Let me look."),
        ("output_text.done", 1),
        ("content_part.done", 1),
        ("output_item.done", 1, "message", "completed"),
        ("output_item.added", 2, "function_call", "in_progress"),
        ("function_call_arguments.delta", 2, '{"q"'),
        ("function_call_arguments.delta", 2, ': "x"}'),
        ("function_call_arguments.done", 2),
        ("output_item.done", 2, "function_call", "completed"),
        ("completed", "completed"),
    ]
    done = events[-2][1]["item"]
    assert (done["call_id"], done["name"], done["arguments"]) == ("call_1", "lookup",
                                                                  '{"q": "x"}')
    assert [i["type"] for i in events[-1][1]["response"]["output"]] == [
        "reasoning", "message", "function_call"]


def test_two_calls_are_two_items_in_order() -> None:
    _, events = run([call(0, "a", "{}", "c0"), call(1, "b", "{}", "c1"),
                     chunk(finish="tool_calls")])
    items = [(e[1]["output_index"], e[1]["item"]["name"]) for e in events
             if e[0] == "response.output_item.done"]
    assert items == [(0, "a"), (1, "b")]


def test_length_ends_incomplete() -> None:
    _, events = run([text("a"), chunk(finish="length")])
    assert short(events[-1]) == ("incomplete", "incomplete")
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_without_usage_the_output_is_counted_in_chunks() -> None:
    _, events = run([text("a"), text("b"), chunk(finish="stop")])
    assert events[-1][1]["response"]["usage"]["output_tokens"] == 2


def test_the_prompts_cached_part_is_input_tokens_details_cached_tokens() -> None:
    """From the usage's cached_tokens, else llama-server's timings (on its last chunk); 0 when
    the upstream says nothing of a cache (the Responses API has no way to say "not known")."""
    for last, cached in ((chunk(usage={**USAGE, "prompt_tokens_details": {"cached_tokens": 5}}),
                          5),
                         ({**chunk(usage=USAGE), "timings": {"cache_n": 6, "prompt_n": 1}}, 6),
                         (chunk(usage=USAGE), 0)):
        _, events = run([text("a"), chunk(finish="stop"), last])
        usage = events[-1][1]["response"]["usage"]
        assert (usage["input_tokens"], usage["input_tokens_details"]) == (
            7, {"cached_tokens": cached}), last


def test_an_end_without_finish_reason_fails() -> None:
    bridge, events = run([text("a")])
    assert [short(e)[0] for e in events][-2:] == ["error", "failed"]
    assert events[-2][1]["code"] == ErrorCode.UPSTREAM_INCOMPLETE
    assert bridge.state is State.FAILED


def test_a_stall_puts_the_notice_in_the_open_message_then_incomplete() -> None:
    bridge, _ = run([text("a")], end=False)
    trip = StallTrip("idle", 1.0, "llm", 30.0, 0.5)
    tail = bridge.stalled(trip)
    assert [short(e)[:2] for e in tail] == [("output_text.delta", 0), ("incomplete", "incomplete")]
    assert "stall guard" in tail[0][1]["delta"]
    response = tail[-1][1]["response"]
    assert response["x_hal0_stall"]["reason"] == "idle"
    assert response["output"][0]["content"][0]["text"].startswith("a\n\n[hal0]")
    assert bridge.feed(text("late")) == [] and bridge.finish() == []


def test_a_stall_in_a_call_closes_it_incomplete_and_opens_a_message() -> None:
    bridge, _ = run([call(0, "lookup", '{"q', "c")], end=False)
    tail = bridge.stalled(StallTrip("total", 2.0, "llm", 1.0, 0.0))
    assert [short(e)[:4] for e in tail][:3] == [
        ("function_call_arguments.done", 0),
        ("output_item.done", 0, "function_call", "incomplete"),
        ("output_item.added", 1, "message", "in_progress"),
    ]


def test_a_stall_before_any_chunk_still_opens_the_response() -> None:
    bridge = Bridge(request(), "m")
    kinds = [e[0] for e in bridge.stalled(StallTrip("idle", 1.0, "llm", 30.0, 0.5))]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"


def test_output_after_the_finish_is_malformed() -> None:
    bridge, _ = run([text("a"), chunk(finish="stop")], end=False)
    with pytest.raises(MalformedChunk):
        bridge.feed(text("b"))


@pytest.mark.parametrize("bad", [
    [], {"choices": {}}, {"choices": [{"delta": {"content": 3}}]},
    {"error": {"message": "boom"}}, {"choices": [], "usage": 3},
    {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}]},
    {"choices": [{"delta": {"tool_calls": "f"}}]},
    {"choices": [{"delta": {}, "finish_reason": "error"}], "error": {"message": "cut"}},
    {"choices": [], "usage": {"prompt_tokens": "9"}},
])
def test_malformed_chunks_are_refused(bad: Any) -> None:
    with pytest.raises(MalformedChunk):
        Bridge(request(), "m").feed(bad)


def test_calls_of_custom_local_shell_and_namespaced_tools_come_back_as_their_items() -> None:
    req = request(tools=CUSTOM_TOOLS)
    _, events = run([call(0, "apply_patch", '{"input": "*** Begin Patch"}', "c0"),
                     call(1, "local_shell", '{"command": ["ls", "-l"], "workdir": "/tmp"}', "c1"),
                     call(2, "agents__spawn", '{"task": "t"}', "c2"),
                     chunk(finish="tool_calls")], req)
    done = [e[1]["item"] for e in events if e[0] == "response.output_item.done"]
    assert done[0] == {**done[0], "type": "custom_tool_call", "name": "apply_patch",
                       "call_id": "c0", "input": "*** Begin Patch"}
    assert done[1]["type"] == "local_shell_call" and done[1]["call_id"] == "c1"
    assert done[1]["action"] == {**done[1]["action"], "type": "exec", "command": ["ls", "-l"],
                                 "working_directory": "/tmp"}
    assert (done[2]["type"], done[2]["name"], done[2]["namespace"]) == (
        "function_call", "spawn", "agents")
    kinds = [e[0] for e in events]
    assert "response.custom_tool_call_input.done" in kinds
    assert kinds.count("response.function_call_arguments.delta") == 1  # the namespaced one


def sse(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(c) + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


STREAM = sse([chunk({"role": "assistant"}), think("a"), text("b"), text("c"),
              call(0, "f", '{"x":', "k"), call(0, arguments=" 1}"), chunk(finish="tool_calls"),
              chunk(usage=USAGE)])


def transformed(data: bytes, cuts: list[int]) -> list[tuple[str | None, Any]]:
    transform = BridgeTransform(Bridge(request(), "m", response_id="resp_x", created_at=1))
    out = b""
    start = 0
    for cut in [*sorted(cuts), len(data)]:
        out += transform.feed(data[start:cut])
        start = cut
    out += transform.end()
    assert transform.complete()
    events = Decoder().feed(out)
    parsed = [(e.event, orjson.loads(e.data)) for e in events]
    for _, payload in parsed:  # ids made per item differ run to run
        payload.pop("item_id", None)
        for holder in (payload.get("item"), *((payload.get("response") or {}).get("output") or ())):
            if isinstance(holder, dict):
                holder.pop("id", None)
    return parsed


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=len(STREAM)), max_size=8))
def test_any_split_of_the_upstream_bytes_gives_the_same_events(cuts: list[int]) -> None:
    assert transformed(STREAM, cuts) == transformed(STREAM, [])


def test_the_transform_ends_a_malformed_stream_failed_keeping_what_came_before() -> None:
    transform = BridgeTransform(Bridge(request(), "m"))
    with pytest.raises(TransformFailed) as raised:
        transform.feed(b"data: " + orjson.dumps(text("a")) + b"\n\ndata: {nope\n\n")
    kinds = [e.event for e in Decoder().feed(raised.value.frame)]
    assert "response.output_text.delta" in kinds and kinds[-2:] == ["error", "response.failed"]
    assert raised.value.error_code == ErrorCode.UPSTREAM_MALFORMED


def test_done_without_a_finish_reason_is_an_incomplete_upstream() -> None:
    transform = BridgeTransform(Bridge(request(), "m"))
    with pytest.raises(TransformFailed) as raised:
        transform.feed(b"data: " + orjson.dumps(text("a")) + b"\n\ndata: [DONE]\n\n")
    assert raised.value.error_code == ErrorCode.UPSTREAM_INCOMPLETE


def test_done_without_a_finish_reason_keeps_the_good_events_of_the_same_read() -> None:
    transform = BridgeTransform(Bridge(request(), "m"))
    with pytest.raises(TransformFailed) as raised:
        transform.feed(b"data: " + orjson.dumps(text("a")) + b"\n\ndata: [DONE]\n\n")
    payloads = [orjson.loads(e.data) for e in Decoder().feed(raised.value.frame)]
    kinds = [p["type"] for p in payloads]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds and kinds[-2:] == ["error", "response.failed"]
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))


def test_a_keepalive_is_a_comment_line_and_the_upstreams_comments_stay_in_their_places() -> None:
    transform = BridgeTransform(Bridge(request(), "m"))
    assert transform.keepalive() == b": ping\n\n"
    assert transform.keepalive("queued, 3 ahead") == b": hal0d: queued, 3 ahead\n\n"
    out = transform.feed(b":\n\n" + sse([text("a")]).removesuffix(b"data: [DONE]\n\n")
                         + b": ping\n\n" + b"data: " + orjson.dumps(text("b")) + b"\n\n")
    assert out.startswith(b": ping\n\nevent: response.created\n")
    before, after = out[len(b": ping\n\n"):].split(b": ping\n\n")
    assert b'"delta":"a"' in before and b'"delta":"b"' in after
    transform.feed(sse([chunk(finish="stop")]))
    assert transform.complete()
    assert transform.keepalive() == b"" and transform.feed(b":\n\n") == b""


def test_a_break_is_an_error_then_failed_and_nothing_after() -> None:
    transform = BridgeTransform(Bridge(request(), "m"))
    transform.feed(b"data: " + orjson.dumps(text("a")) + b"\n\n")
    kinds = [e.event for e in Decoder().feed(transform.broken("cut"))]
    assert kinds == ["error", "response.failed"]
    assert transform.broken("again") == b"" and transform.complete()
