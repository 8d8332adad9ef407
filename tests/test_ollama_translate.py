"""The Ollama translation as playbooks: Ollama requests in, OpenAI bodies out; upstream SSE in,
Ollama NDJSON out, the same however the reads cut it (pure: no sockets, fixed clocks)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.errors import ErrorCode, InvalidRequest
from hal0d.ollama.request import (
    KEEP_FOR_EVER,
    go_duration,
    parse_chat,
    parse_generate,
    parse_keep_alive,
)
from hal0d.ollama.stream import NS, Clocks, Translator
from hal0d.ollama.transform import OllamaTransform
from hal0d.protocol.transform import StallTrip, TransformFailed

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR4nGNgYGD4DwABBAEAwS2OUAAAAABJRU5E"
       "rkJggg==")


def sse(*chunks: dict[str, Any]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks) + \
        b"data: [DONE]\n\n"


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def finish(reason: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 2}}


class FixedClock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        self.t += 0.5
        return self.t


def transform(*, chat: bool = True, think: bool | None = False) -> OllamaTransform:
    clock = FixedClock()
    clocks = Clocks(started=9.0, opened=10.0, load_s=0.25, now=clock, wall=lambda: 0.0)
    return OllamaTransform(Translator("m", clocks, chat=chat, think=think))


def lines(data: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in data.splitlines()]


def run(body: bytes, **options: Any) -> list[dict[str, Any]]:
    t = transform(**options)
    return lines(t.feed(body) + t.end())


def test_content_chunks_become_message_objects_and_a_last_done_object_with_counts() -> None:
    out = run(sse(delta(role="assistant", content=None), delta(content="Hel"),
                  delta(content="lo"), finish("stop"), USAGE))
    assert [o["message"]["content"] for o in out] == ["Hel", "lo", ""]
    assert [o["done"] for o in out] == [False, False, True]
    last = out[-1]
    assert (last["done_reason"], last["prompt_eval_count"], last["eval_count"]) == ("stop", 7, 2)
    assert last["load_duration"] == 0.25 * NS
    assert last["created_at"] == "1970-01-01T00:00:00.000000Z"
    assert last["total_duration"] > last["eval_duration"] > 0


def test_reasoning_is_thinking_unless_think_is_false_and_then_left_out() -> None:
    body = sse(delta(reasoning_content="hmm"), delta(content="ok"), finish("stop"))
    for think in (True, None):  # not said: as Ollama does for a model that thinks
        assert [o["message"].get("thinking") for o in run(body, think=think)] == [
            "hmm", None, None]
    assert [o["message"]["content"] for o in run(body, think=False)] == ["ok", ""]


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_reasoning_alone_with_think_false_is_the_answers_content_at_its_finish(
        chat: bool) -> None:
    """Never an empty message where the model said something."""
    body = sse(delta(reasoning_content="I "), delta(reasoning_content="think"), finish("stop"),
               USAGE)
    out = run(body, chat=chat, think=False)
    said = [o["message"] if chat else o for o in out]
    assert [piece["content" if chat else "response"] for piece in said] == ["I think", ""]
    assert not any("thinking" in piece for piece in said) and out[-1]["done"] is True
    with_a_call = sse(delta(reasoning_content="hm"), delta(tool_calls=[
        {"index": 0, "id": "c", "function": {"name": "f", "arguments": "{}"}}]),
        finish("tool_calls"))
    assert [o["message"]["content"] for o in run(with_a_call, think=False)] == ["", ""]


def test_tool_call_fragments_become_one_call_with_arguments_as_an_object() -> None:
    first = {"index": 0, "id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": ""}}
    body = sse(delta(tool_calls=[first]),
               delta(tool_calls=[{"index": 0, "function": {"arguments": '{"city"'}}]),
               delta(tool_calls=[{"index": 0, "function": {"arguments": ': "Paris"}'}}]),
               finish("tool_calls"))
    out = run(body)
    assert out[0]["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"index": 0, "name": "get_weather",
                                      "arguments": {"city": "Paris"}}}]
    assert out[-1]["done_reason"] == "stop" and out[-1]["eval_count"] == 3


def test_generate_speaks_response_and_a_length_finish_is_length() -> None:
    out = run(sse(delta(content="a"), finish("length")), chat=False)
    assert [o["response"] for o in out] == ["a", ""]
    assert out[-1]["done_reason"] == "length"


def test_a_stream_without_finish_reason_ends_with_an_error_line() -> None:
    t = transform()
    t.feed(b"data: " + orjson.dumps(delta(content="a")) + b"\n\n")
    with pytest.raises(TransformFailed) as failed:
        t.end()
    assert failed.value.error_code == ErrorCode.UPSTREAM_INCOMPLETE
    assert "error" in lines(failed.value.frame)[-1]


@pytest.mark.parametrize(("bad", "message"), [
    pytest.param({"object": "error", "message": "boom"}, "upstream reported an error: boom",
                 id="vLLM error object"),
    pytest.param({"choices": [], "usage": [7]}, "upstream chunk: usage is not an object",
                 id="usage not an object"),
    pytest.param(
        delta(tool_calls=[{"index": 0, "function": {"name": "f", "arguments": {"q": 1}}}]),
        "upstream chunk: tool call id, name or arguments is not a string",
        id="arguments an object"),
])
def test_a_malformed_chunk_ends_the_stream_with_its_message_after_what_came_before(
        bad: dict[str, Any], message: str) -> None:
    """Each of these was once passed over: the error's message lost to "ended without a
    finish_reason", the counts made up from the chunks, the call's arguments dropped."""
    t = transform()
    with pytest.raises(TransformFailed) as failed:
        t.feed(b"data: " + orjson.dumps(delta(content="a")) + b"\n\n"
               + b"data: " + orjson.dumps(bad) + b"\n\n")
    assert failed.value.error_code == ErrorCode.UPSTREAM_MALFORMED
    out = lines(failed.value.frame)
    assert out[0]["message"]["content"] == "a" and out[-1] == {"error": message}


def test_a_stall_ends_with_the_notice_done_length_and_x_hal0_stall_and_a_break_with_error() -> None:
    t = transform()
    t.feed(b"data: " + orjson.dumps(delta(content="a")) + b"\n\n")
    last = lines(t.stalled(StallTrip("idle", 3.0, "llm", 900.0, 3.0)))[-1]
    assert last["done"] is True and last["done_reason"] == "length"
    assert "stall guard" in last["message"]["content"]
    assert last["x_hal0_stall"]["reason"] == "idle"
    message = "upstream 'llm' broke the stream"
    for said, notice in ((b"", f"[hal0] no answer: {message}"),
                         (b"data: " + orjson.dumps(delta(content="a")) + b"\n\n",
                          f"\n\n[hal0] the answer was cut off: {message}")):
        broken = transform()
        broken.feed(said)
        # The failure in words as a piece of the answer, then the line a client raises on.
        assert lines(broken.broken(message)) == [
            {"model": "m", "created_at": "1970-01-01T00:00:00.000000Z",
             "message": {"role": "assistant", "content": notice}, "done": False},
            {"error": message}]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=400), max_size=8))
def test_any_split_of_the_upstream_bytes_gives_the_same_objects(cuts: list[int]) -> None:
    body = sse(delta(reasoning_content="hm"), delta(content="Hé"), delta(content="llo"),
               finish("stop"), USAGE)
    whole = [{k: v for k, v in o.items() if "duration" not in k} for o in run(body, think=True)]
    t = transform(think=True)
    out = b""
    start = 0
    for cut in sorted(min(c, len(body)) for c in cuts):
        out += t.feed(body[start:cut])
        start = max(start, cut)
    out += t.feed(body[start:]) + t.end()
    assert [{k: v for k, v in o.items() if "duration" not in k} for o in lines(out)] == whole


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "generate"])
def test_a_keepalive_is_an_object_with_empty_content_not_done(chat: bool) -> None:
    t = transform(chat=chat)
    said = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    empty = {"model": "m", "created_at": "1970-01-01T00:00:00.000000Z", **said, "done": False}
    assert lines(t.keepalive()) == [empty]
    assert lines(t.keepalive("loading m, 12 s")) == [empty]  # no field to say it in
    # The upstream's comment lines, in their places among the chunks of the same read.
    out = lines(t.feed(b":\n\ndata: " + orjson.dumps(delta(content="a")) + b"\n\n: ping\n\n"))
    assert out[0] == empty and out[2] == empty
    assert (out[1]["message"]["content"] if chat else out[1]["response"]) == "a"
    t.feed(sse(finish("stop")))
    assert t.complete()
    assert t.keepalive() == b"" and t.feed(b":\n\n") == b""


def test_chat_request_maps_images_tools_format_options_and_tool_results() -> None:
    req = parse_chat({
        "model": "m", "format": {"type": "object"}, "keep_alive": "1h30m",
        "options": {"num_predict": 64, "temperature": 0.2, "seed": 3, "num_ctx": 8192,
                    "stop": ["\n"], "repeat_penalty": 1.1, "made_up": 1},
        "messages": [
            {"role": "user", "content": "what is it?", "images": [PNG]},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "look", "arguments": {"at": "it"}}}]},
            {"role": "tool", "tool_name": "look", "content": "a dot"},
        ]})
    body = req.payload("served")
    assert body["model"] == "served" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["messages"][0]["content"][1]["image_url"]["url"].startswith(
        "data:image/png;base64,iVBOR")
    call = body["messages"][1]["tool_calls"][0]
    assert orjson.loads(call["function"]["arguments"]) == {"at": "it"}
    assert body["messages"][2] == {"role": "tool", "content": "a dot", "tool_call_id": call["id"]}
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert (body["max_tokens"], body["temperature"], body["seed"], body["stop"],
            body["repeat_penalty"]) == (64, 0.2, 3, ["\n"], 1.1)
    assert [name for name, _ in req.ignored] == ["num_ctx", "made_up"] and "num_ctx" not in body
    assert req.keep_alive_s == 5400.0


def test_generate_request_is_a_system_and_a_user_message_and_an_empty_one_only_loads() -> None:
    req = parse_generate({"model": "m", "prompt": "hi", "system": "be brief", "stream": False,
                          "format": "json"})
    body = req.payload("m")
    assert body["messages"] == [{"role": "system", "content": "be brief"},
                                {"role": "user", "content": "hi"}]
    assert body["response_format"] == {"type": "json_object"} and "stream" not in body
    assert parse_generate({"model": "m"}).load_only


@pytest.mark.parametrize(("given", "seconds"), [
    (0, 0.0), (300, 300.0), (-1, KEEP_FOR_EVER), ("10m", 600.0), ("1h30m", 5400.0),
    ("1.5s", 1.5), ("300ms", 0.3), ("-1m", KEEP_FOR_EVER), ("0", 0.0), (None, None)])
def test_keep_alive_reads_ollamas_durations(given: object, seconds: float | None) -> None:
    assert parse_keep_alive(given) == seconds


@pytest.mark.parametrize("bad", ["10", "ten minutes", "5 m", "", True])
def test_a_keep_alive_that_is_no_duration_is_refused(bad: object) -> None:
    with pytest.raises(InvalidRequest):
        parse_keep_alive(bad)
    assert go_duration("1h2m3s") == 3723.0
