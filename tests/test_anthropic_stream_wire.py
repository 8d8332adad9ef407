"""The translator's events on the wire: compact named frames, the whole way from a real
upstream's captured bytes through the Decoder and the Translator, the anthropic SDK reading our
frames (a message, a failure, pings anywhere), and the property that any read boundaries of any
upstream stream give the same, valid stream."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.anthropic.stream import Translator, encode_events
from tests.anthropic_rules import assemble, assert_valid_anthropic_stream, events_from_sse
from tests.fixtures_util import fixture_path
from tests.harness.anthropic_stream import (
    DONE,
    PING,
    call,
    finish,
    play,
    role,
    run_pipeline,
    say,
    sdk_client,
    think,
    upstream_streams,
    usage,
)

# --- wire format -------------------------------------------------------------------------------


def test_encode_events_is_compact_named_frames() -> None:
    events = play(
        [role(), think("hmm"), say("Hi"), call(0, '{"q":1}', id="c", name="f"), finish(), DONE],
        input_tokens=1,
    )
    raw = encode_events(events)
    frames = raw.split(b"\n\n")
    assert frames[-1] == b""
    for frame in frames[:-1]:
        event_line, data_line = frame.split(b"\n")
        name = event_line.removeprefix(b"event: ")
        assert event_line.startswith(b"event: ") and data_line.startswith(b"data: ")
        assert data_line.startswith(b'data: {"type":"' + name + b'"')
        json_text = data_line.removeprefix(b"data: ")
        assert json_text == orjson.dumps(orjson.loads(json_text))
        assert b": " not in json_text and b", " not in json_text
    assert events_from_sse(raw) == events
    assert encode_events([]) == b""


# --- the whole way: upstream bytes -> Decoder -> Translator -> frames ---------------------------


def test_llama_cpp_python_capture_translates() -> None:
    raw = fixture_path("llama-cpp-python-0.3.36-smollm2-stream.sse").read_bytes()
    events = run_pipeline([raw], input_tokens=36)
    assert assert_valid_anthropic_stream(events) == "success"
    message = assemble(events)
    assert message["content"] == [
        {"type": "text", "text": "Hello, welcome to my little corner of the world!"}
    ]
    assert message["stop_reason"] == "end_turn"
    assert message["usage"] == {"input_tokens": 36, "output_tokens": 11}
    for cut in range(0, len(raw), 53):
        assert (
            run_pipeline(
                [raw[:cut], raw[cut:]], message_id=events[0][1]["message"]["id"], input_tokens=36
            )
            == events
        )


def test_anthropic_sdk_accepts_the_stream() -> None:
    events = play(
        [
            role(),
            think("Because."),
            say("Hi"),
            call(0, '{"q": 1}', id="call_1", name="lookup"),
            finish("tool_calls"),
            usage(10, 4),
            DONE,
        ]
    )
    client = sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=64, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[1].text == "Hi"  # type: ignore[union-attr]
    assert message.content[2].input == {"q": 1}  # type: ignore[union-attr]
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (10, 4)


def test_anthropic_sdk_raises_on_a_failed_stream() -> None:
    import anthropic

    translator = Translator("client-model")
    events = translator.feed(say("partial")) + translator.fail("upstream went away")
    client = sdk_client(encode_events(events))
    request = client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    with pytest.raises(anthropic.APIStatusError, match="upstream went away"), request as stream:
        stream.get_final_message()


def test_the_sdk_reads_pings_anywhere_in_the_stream_as_nothing() -> None:
    events = play([PING, role(), say("Hi"), PING, say("!"), finish(), PING, usage(4, 2), DONE],
                  input_tokens=4)
    client = sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert message.content[0].text == "Hi!"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


# --- property: any read boundaries give the same, valid stream ----------------------------------


@settings(max_examples=150, deadline=None)
@given(stream=upstream_streams(), data=st.data())
def test_any_split_of_the_upstream_gives_the_same_valid_stream(
    stream: tuple[bytes, list[dict[str, Any]]], data: st.DataObject
) -> None:
    raw, expected = stream
    whole = run_pipeline([raw], message_id="msg_x")
    cuts = sorted(data.draw(st.lists(st.integers(0, len(raw)), max_size=16)))
    bounds = [0, *cuts, len(raw)]
    assert (
        run_pipeline([raw[a:b] for a, b in itertools.pairwise(bounds)], message_id="msg_x") == whole
    )
    assert assert_valid_anthropic_stream(whole) == "success"
    assert events_from_sse(encode_events(whole)) == whole
    blocks = assemble(whole)["content"]
    for block in blocks:
        block.pop("signature", None)
    assert blocks == expected
