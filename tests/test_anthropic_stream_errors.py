"""The translator's states and failures: each chunk translated as it arrives, fail() at every
point of a stream (one error event, and nothing after), the calls that are impossible in a state
(they raise), and malformed chunks or impossible upstream orders (MalformedChunk; fail() still
ends the stream validly)."""

from __future__ import annotations

from typing import Any

import pytest

from hal0d.anthropic.stream import MalformedChunk, State, Translator, TranslatorError
from tests.anthropic_rules import assert_valid_anthropic_stream
from tests.harness.anthropic_stream import call, finish, say, short, usage


def test_each_chunk_is_translated_as_it_arrives() -> None:
    translator = Translator("m")
    assert [short(e) for e in translator.feed(say("a"))] == [
        ("message_start", 0),
        ("start", 0, "text"),
        ("delta", 0, "a"),
    ]
    assert [short(e) for e in translator.feed(say("b"))] == [("delta", 0, "b")]
    assert [short(e) for e in translator.feed(finish())] == [("stop", 0)]
    assert translator.state is State.STOPPING
    assert [short(e) for e in translator.feed(usage(1, 2))] == [
        ("message_delta", "end_turn", None, 1, 2),
        ("message_stop",),
    ]
    assert translator.done and translator.state is State.DONE
    assert translator.feed(usage(1, 2)) == []
    assert translator.feed(say("late")) == []
    assert translator.finish() == []
    assert translator.state is State.CLOSED


def test_fail_mid_stream_is_one_error_and_nothing_else() -> None:
    translator = Translator("m")
    events = translator.feed(say("a"))
    failure = translator.fail("upstream closed the connection", error_type="overloaded_error")
    assert [short(e) for e in failure] == [
        ("error", "overloaded_error", "upstream closed the connection")
    ]
    assert translator.state is State.FAILED and translator.done
    assert assert_valid_anthropic_stream(events + failure) == "error"


def test_fail_while_waiting_for_usage() -> None:
    translator = Translator("m")
    events = translator.feed(say("a")) + translator.feed(finish())
    failure = translator.fail("stall guard: idle")
    assert [short(e) for e in failure] == [("error", "api_error", "stall guard: idle")]
    assert "message_delta" not in [name for name, _ in events + failure]
    assert assert_valid_anthropic_stream(events + failure) == "error"


def test_fail_before_anything_is_only_the_error() -> None:
    translator = Translator("m")
    assert [short(e) for e in translator.fail("shutting down")] == [
        ("error", "api_error", "shutting down")
    ]


def _finished() -> Translator:
    translator = Translator("m")
    translator.feed(finish())
    translator.finish()
    return translator


def _failed() -> Translator:
    translator = Translator("m")
    translator.feed(say("a"))
    translator.fail("x")
    return translator


def _begun() -> Translator:
    translator = Translator("m")
    translator.begin()
    return translator


def _streaming() -> Translator:
    translator = Translator("m")
    translator.feed(say("a"))
    return translator


def _stopped() -> Translator:
    translator = Translator("m")
    translator.feed(finish(usage={"prompt_tokens": 1, "completion_tokens": 1}))
    return translator


@pytest.mark.parametrize(
    ("make", "action"),
    [
        pytest.param(_begun, lambda t: t.begin(), id="begin twice"),
        pytest.param(_streaming, lambda t: t.begin(), id="begin after the first chunk"),
        pytest.param(_stopped, lambda t: t.begin(), id="begin after message_stop"),
        pytest.param(_stopped, lambda t: t.ping(), id="ping after message_stop"),
        pytest.param(_finished, lambda t: t.ping(), id="ping after finish"),
        pytest.param(_failed, lambda t: t.ping(), id="ping after fail"),
        pytest.param(_finished, lambda t: t.feed(say("a")), id="feed after finish"),
        pytest.param(_failed, lambda t: t.feed(say("a")), id="feed after fail"),
        pytest.param(_finished, lambda t: t.finish(), id="finish twice"),
        pytest.param(_failed, lambda t: t.finish(), id="finish after fail"),
        pytest.param(_failed, lambda t: t.fail("again"), id="fail after fail"),
        pytest.param(_stopped, lambda t: t.fail("late"), id="fail after message_stop"),
        pytest.param(_finished, lambda t: t.fail("late"), id="fail after finish"),
    ],
)
def test_impossible_orders_raise(make: Any, action: Any) -> None:
    translator = make()
    with pytest.raises(TranslatorError):
        action(translator)


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param("not a dict", id="chunk not an object"),
        pytest.param({"choices": {"0": {}}}, id="choices not a list"),
        pytest.param({"choices": "x"}, id="choices a string"),
        pytest.param({"choices": [5]}, id="choice not an object"),
        pytest.param({"choices": [{"delta": "hi"}]}, id="delta not an object"),
        pytest.param({"choices": [{"delta": {"content": 5}}]}, id="content not a string"),
        pytest.param(
            {"choices": [{"delta": {"reasoning_content": ["x"]}}]}, id="reasoning not a string"
        ),
        pytest.param(
            {"choices": [{"delta": {"tool_calls": {"index": 0}}}]}, id="tool_calls not a list"
        ),
        pytest.param(
            {"choices": [{"delta": {"tool_calls": [{"index": "0", "function": {"name": "f"}}]}}]},
            id="tool index not int",
        ),
        pytest.param(
            {
                "choices": [
                    {"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}}
                ]
            },
            id="new tool call without name",
        ),
        pytest.param(
            {"choices": [{"delta": {}, "finish_reason": 1}]}, id="finish_reason not a string"
        ),
        pytest.param({"choices": [], "usage": [1]}, id="usage not an object"),
        pytest.param(
            {"choices": [], "usage": {"completion_tokens": "3"}}, id="usage count not an int"
        ),
        pytest.param({"error": {"message": "CUDA out of memory"}}, id="upstream error object"),
        pytest.param({"object": "error", "message": "boom"}, id="vLLM error object"),
        pytest.param(
            {**finish("error"), "error": {"message": "provider disconnected"}},
            id="error beside a finish_reason",
        ),
    ],
)
def test_malformed_chunk_raises_and_fail_still_works(bad: Any) -> None:
    for prefix in ([], [say("a")]):
        translator = Translator("m")
        events = [e for c in prefix for e in translator.feed(c)]
        state = translator.state
        with pytest.raises(MalformedChunk) as caught:
            translator.feed(bad)
        assert translator.state is state
        events += translator.fail(str(caught.value))
        assert assert_valid_anthropic_stream(events) == "error"


def test_upstream_error_message_is_kept() -> None:
    with pytest.raises(MalformedChunk, match="CUDA out of memory"):
        Translator("m").feed({"error": {"message": "CUDA out of memory"}})


@pytest.mark.parametrize(
    "script",
    [
        pytest.param([say("a"), finish(), say("b")], id="content after finish_reason"),
        pytest.param(
            [call(0, id="a", name="f"), call(1, id="b", name="g"), call(0, "{}")],
            id="earlier tool call resumes",
        ),
        pytest.param(
            [call(0, id="a", name="f"), say("x"), call(0, "{}")], id="tool call resumes after text"
        ),
    ],
)
def test_impossible_upstream_orders_are_malformed(script: list[dict[str, Any]]) -> None:
    translator = Translator("m")
    for step in script[:-1]:
        translator.feed(step)
    with pytest.raises(MalformedChunk):
        translator.feed(script[-1])
