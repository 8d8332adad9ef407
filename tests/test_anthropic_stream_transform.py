"""The transform around the translator (AnthropicTransform): what the forward path sends before
the upstream's first byte (message_start once, pings as keepalives), what it sends on a failure
after the head or before anything, and the property that any read boundaries of any upstream
stream give the same frames, a ping per keepalive comment."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.anthropic.stream import Translator
from hal0d.anthropic.transform import AnthropicTransform
from tests.anthropic_rules import assert_valid_anthropic_stream, events_from_sse
from tests.harness.anthropic_stream import (
    assert_pings_wait_for_message_start,
    finish,
    role,
    run_pipeline,
    say,
    sdk_client,
    short,
    upstream_streams,
    usage,
)

# --- the transform: what the forward path sends before the upstream's first byte -------------


def _transform(input_tokens: int | None = 9) -> AnthropicTransform:
    return AnthropicTransform(Translator("client-model", input_tokens=input_tokens))


def test_opening_is_message_start_once_and_the_chunks_follow_it() -> None:
    transform = _transform()
    [(name, payload)] = events_from_sse(transform.opening(input_tokens=21))
    assert name == "message_start" and payload["message"]["usage"]["input_tokens"] == 21
    assert transform.opening() == b""
    assert transform.start() == b""
    body = b"".join(b"data: " + orjson.dumps(c) + b"\n\n"
                    for c in [role(), say("Hi"), finish(), usage(30, 1)])
    events = [(name, payload), *events_from_sse(transform.feed(body))]
    assert [short(e) for e in events] == [
        ("message_start", 21), ("start", 0, "text"), ("delta", 0, "Hi"), ("stop", 0),
        ("message_delta", "end_turn", None, 30, 1), ("message_stop",)]
    assert transform.complete() and transform.opening() == b""


def test_keepalive_is_a_ping_after_message_start_and_nothing_once_the_stream_ended() -> None:
    transform = _transform()
    assert [short(e) for e in events_from_sse(transform.keepalive())] == [
        ("message_start", 9), ("ping",)]
    assert transform.keepalive("loading, 12 s") == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert transform.opening() == b""
    transform.broken("gone")
    assert transform.keepalive() == b""


def test_failed_after_the_head_is_the_error_event_the_sdk_raises_on() -> None:
    import anthropic

    transform = _transform()
    out = transform.opening() + transform.keepalive()
    out += transform.failed("slot 'llm' failed to load: exit 1", "overloaded_error")
    events = events_from_sse(out)
    assert [short(e) for e in events] == [
        ("message_start", 9), ("ping",),
        ("error", "overloaded_error", "slot 'llm' failed to load: exit 1")]
    assert events[-1][1] == {"type": "error", "error": {
        "type": "overloaded_error", "message": "slot 'llm' failed to load: exit 1"}}
    assert assert_valid_anthropic_stream(events) == "error"
    assert transform.failed("again", "api_error") == b"" and transform.keepalive() == b""
    assert transform.broken("late") == b"" and transform.end() == b""
    request = sdk_client(out).messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(anthropic.APIStatusError, match="failed to load"), request as stream:
        stream.get_final_message()


def test_failed_before_anything_is_the_error_alone_and_after_message_stop_nothing() -> None:
    transform = _transform()
    assert [short(e) for e in events_from_sse(transform.failed("queue cleared", "api_error"))] == [
        ("error", "api_error", "queue cleared")]
    done = _transform()
    done.feed(b"data: " + orjson.dumps(finish(usage={"prompt_tokens": 1, "completion_tokens": 0}))
              + b"\n\n")
    assert done.complete()
    assert done.failed("late", "api_error") == b""


def through_transform(pieces: list[bytes]) -> bytes:
    transform = AnthropicTransform(Translator("client-model", message_id="msg_x"))
    return b"".join(transform.feed(piece) for piece in pieces) + transform.end()


@settings(max_examples=100, deadline=None)
@given(stream=upstream_streams(), data=st.data())
def test_any_split_through_the_transform_gives_the_same_frames_a_ping_per_comment(
    stream: tuple[bytes, list[dict[str, Any]]], data: st.DataObject
) -> None:
    raw, _ = stream
    whole = through_transform([raw])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=16)))
    bounds = [0, *cuts, len(raw)]
    assert through_transform([raw[a:b] for a, b in itertools.pairwise(bounds)]) == whole
    events = events_from_sse(whole)
    pings = [name for name, _ in events].count("ping")
    comment = raw.find(b": keepalive")
    if comment < 0:
        assert pings == 0
    elif comment < raw.find(b'"finish_reason":"'):
        assert pings == 1
    else:
        assert pings <= 1  # none once message_stop is out
    assert_pings_wait_for_message_start(events)
    assert_valid_anthropic_stream(events)
    expected = run_pipeline([raw], message_id="msg_x")
    if 0 <= comment < raw.find(b"data:"):  # message_start went out before the first chunk
        expected[0][1]["message"]["usage"]["input_tokens"] = 0
    assert [e for e in events if e[0] != "ping"] == expected
