"""Fuzzing with hypothesis: upstream byte streams (chunks of every kind, cut anywhere, the `[DONE]`
line split over reads) through the Anthropic translator and the passthrough relay. Request
bodies against a running hal0d are in test_fuzz.py."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import orjson
from aiohttp import hdrs, web
from hypothesis import given
from hypothesis import strategies as st

from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.openai.transform import Passthrough
from hal0d.protocol.transform import TransformFailed
from tests.anthropic_rules import assert_valid_anthropic_stream, events_from_sse
from tests.harness.fuzzing import EXAMPLES, FUZZ, json_values


def chunk_bytes(delta: dict[str, Any] | None = None, finish: Any = None,
                usage: dict[str, Any] | None = None) -> bytes:
    payload: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "model": "m",
                               "choices": [] if delta is None else
                               [{"index": 0, "delta": delta, "finish_reason": finish}]}
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


deltas = st.sampled_from([
    {"role": "assistant", "content": None}, {"content": "Hel"}, {"content": "lo é🙂"},
    {"reasoning_content": "hmm"}, {"reasoning": "so"}, {"content": ""},
    {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                     "function": {"name": "lookup", "arguments": ""}}]},
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\"q\": "}}]},
    {"tool_calls": [{"index": 1, "id": "call_2", "function": {"name": "other",
                                                              "arguments": "{}"}}]},
    {"content": "x", "reasoning_content": "y"},
]) | st.dictionaries(st.sampled_from(["content", "reasoning_content", "tool_calls", "role"]),
                     json_values, max_size=2)
finishes = st.sampled_from([None, None, "stop", "length", "tool_calls", "content_filter"]) \
    | json_values
usages = st.none() | st.fixed_dictionaries(
    {"prompt_tokens": st.integers(0, 50), "completion_tokens": st.integers(0, 50)}) | json_values
good_events = st.builds(chunk_bytes, deltas, finishes, usages)
bad_events = st.sampled_from([
    b"data: [DONE]\n\n", b"data: {\"choices\": [\n\n", b"data: \xff\xfe\n\n", b": ping\n\n",
    b"event: message\n", b"data: \n\n", b"\n\n", b"\r\n", b"data: null\n\n", b"data: []\n\n",
    b"data: {\"error\": {\"message\": \"boom\"}}\n\n", b"id: 7\nretry: 10\n",
    b"data: {\"choices\": \"x\"}\n\n", b"data: {\"usage\": {\"prompt_tokens\": -1}}\n\n",
    b"\xef\xbb\xbf", b"data:[DONE]\r\n\r\n",
]) | st.binary(max_size=24) | st.builds(lambda v: b"data: " + json.dumps(v).encode() + b"\n\n",
                                         json_values)
event_lists = st.lists(good_events | good_events | bad_events, max_size=14)


well_formed = st.builds(
    lambda deltas_, finish, usage, done: b"".join(
        [chunk_bytes({"role": "assistant", "content": None})]
        + [chunk_bytes(delta) for delta in deltas_]
        + ([chunk_bytes({}, finish)] if finish else [])
        + ([chunk_bytes(None, None, usage)] if usage else [])
        + ([b"data: [DONE]\n\n"] if done else [])
    ),
    st.lists(deltas, max_size=6),
    st.sampled_from([None, "stop", "length", "tool_calls"]),
    st.none() | st.fixed_dictionaries({"prompt_tokens": st.integers(0, 50),
                                       "completion_tokens": st.integers(0, 50)}),
    st.booleans(),
)


@st.composite
def byte_streams(draw: st.DrawFn) -> list[bytes]:
    """A well-formed stream, maybe with garbage spliced in, or events in any order; then maybe
    truncated mid-event, and cut at arbitrary points into reads."""
    if draw(st.booleans()):
        data = draw(well_formed)
        for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
            at = draw(st.integers(0, len(data)))
            data = data[:at] + draw(bad_events) + data[at:]
    else:
        data = b"".join(draw(event_lists))
    if data and draw(st.sampled_from([False, False, True])):
        data = data[: draw(st.integers(0, len(data)))]
    cuts = sorted(set(draw(st.lists(st.integers(0, len(data)), max_size=8))))
    pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    return [piece for piece in pieces if piece]


def translate(pieces: list[bytes]) -> bytes:
    """What the Anthropic surface writes for these upstream reads (relay's contract)."""
    transform = AnthropicTransform(Translator("claude-fuzz", input_tokens=3))
    out = b""
    try:
        for piece in pieces:
            out += transform.feed(piece)
        out += transform.end()
    except TransformFailed as failed:
        out += failed.frame
    return out


def test_fuzzed_upstream_streams_always_translate_into_valid_anthropic_events():
    endings: Counter[str] = Counter()

    @FUZZ
    @given(byte_streams())
    def one(pieces: list[bytes]) -> None:
        events = events_from_sse(translate(pieces))
        endings[assert_valid_anthropic_stream(events)] += 1

    one()
    print(f"fuzz translator: {sum(endings.values())} upstream byte streams, endings "
          f"{dict(endings)}, rule violations: 0, exceptions other than TransformFailed: 0")
    assert sum(endings.values()) >= EXAMPLES and endings["success"] and endings["error"]


DONE_LINES = (b"data: [DONE]", b"data:[DONE]")


def test_fuzzed_upstream_streams_pass_the_relay_verbatim_and_a_cut_one_is_never_called_complete():
    """The passthrough does not parse: it must deliver every byte as it came, and judge a stream
    complete exactly when it ends with `data: [DONE]` (trailing blank lines aside). A stream
    whose [DONE] line is split over three reads is the known bug tested below; here the final
    line arrives within the last read, as every server we know writes it."""
    verdicts: Counter[str] = Counter()

    @FUZZ
    @given(byte_streams())
    def one(pieces: list[bytes]) -> None:
        transform = Passthrough(sse=True, legacy_completion=False, model="m", expect_done=True)
        relayed = b"".join(transform.feed(piece) for piece in pieces)
        assert relayed == b"".join(pieces)  # verbatim, whatever the bytes
        complete = relayed.rstrip().endswith(DONE_LINES)
        try:
            tail = transform.end()
        except TransformFailed as failed:
            assert failed.error_code == "upstream_incomplete"
            assert failed.frame.startswith(b"\n\ndata: ") and failed.frame.endswith(b"}\n\n")
            error = orjson.loads(failed.frame.strip().removeprefix(b"data: "))["error"]
            assert error["code"] == "dispatch.upstream_incomplete" and error["message"]
            assert not (complete and pieces[-1].rstrip().endswith(DONE_LINES)), (
                "a complete stream was reported as cut")
            verdicts["cut"] += 1
            return
        assert tail == b""
        assert complete, f"a cut stream was passed as complete: {relayed[-80:]!r}"
        verdicts["complete"] += 1

    one()
    print(f"fuzz relay: {sum(verdicts.values())} upstream byte streams relayed byte for byte, "
          f"verdicts {dict(verdicts)}, cut streams passed as complete: 0")
    assert sum(verdicts.values()) >= EXAMPLES and verdicts["complete"] and verdicts["cut"]


async def test_a_complete_stream_whose_done_line_arrives_in_three_reads_is_complete(
    upstream_app, start_hal0d, http, tmp_path
):
    async def upstream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for piece in (chunk_bytes({"content": "hi"}, "stop"), b"data: [DONE]", b"\n", b"\n"):
            await response.write(piece)
            await asyncio.sleep(0.05)  # each piece its own read
        await response.write_eof()
        return response

    url = await upstream_app({"POST /v1/chat/completions": upstream})
    hal0d = await start_hal0d(url)
    body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=body,
                         headers={"X-Request-Id": "three-reads"}) as resp:
        raw = await resp.read()
    assert raw == chunk_bytes({"content": "hi"}, "stop") + b"data: [DONE]\n\n", raw[-200:]
