"""The streaming translator as playbooks: OpenAI chunks in, Anthropic events out.

Events are written in a short form (see `short`) so each case reads as the stream a client sees.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hal0d.anthropic.stream import (
    Event,
    MalformedChunk,
    State,
    Translator,
    TranslatorError,
    encode_events,
)
from hal0d.anthropic.transform import AnthropicTransform
from hal0d.protocol.sse import Decoder
from tests.anthropic_rules import (
    assemble,
    assert_valid_anthropic_stream,
    events_from_sse,
)
from tests.fixtures_util import fixture_path

if TYPE_CHECKING:
    import anthropic

DONE = "[DONE]"


def chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    usage: dict[str, int] | None = None,
    **choice: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish, **choice}],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def role() -> dict[str, Any]:
    return chunk({"role": "assistant", "content": None})


def think(text: str, *, field: str = "reasoning_content", **kw: Any) -> dict[str, Any]:
    return chunk({field: text}, **kw)


def say(text: str, **kw: Any) -> dict[str, Any]:
    return chunk({"content": text}, **kw)


def call(
    index: int, args: str = "", *, id: str | None = None, name: str | None = None
) -> dict[str, Any]:
    entry: dict[str, Any] = {"index": index, "function": {"arguments": args}}
    if id is not None:
        entry["id"] = id
        entry["type"] = "function"
    if name is not None:
        entry["function"]["name"] = name
    return chunk({"tool_calls": [entry]})


def finish(reason: str = "stop", **kw: Any) -> dict[str, Any]:
    return chunk({}, finish=reason, **kw)


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        },
    }


def short(event: Event) -> tuple[Any, ...]:
    name, p = event
    if name == "message_start":
        return ("message_start", p["message"]["usage"]["input_tokens"])
    if name == "content_block_start":
        return ("start", p["index"], p["content_block"]["type"])
    if name == "content_block_delta":
        d = p["delta"]
        return ("delta", p["index"], d.get("thinking", d.get("text", d.get("partial_json"))))
    if name == "content_block_stop":
        return ("stop", p["index"])
    if name == "message_delta":
        u = p["usage"]
        return (
            "message_delta",
            p["delta"]["stop_reason"],
            p["delta"]["stop_sequence"],
            u["input_tokens"],
            u["output_tokens"],
        )
    if name == "message_stop":
        return ("message_stop",)
    if name == "error":
        return ("error", p["error"]["type"], p["error"]["message"])
    if name == "ping":
        assert p == {"type": "ping"}
        return ("ping",)
    raise AssertionError(name)


BEGIN = "begin"  # message_start before the first chunk (the response's head went out)
PING = "ping"  # a keepalive (the upstream's comment line, or hal0d's own while it waits)


def play(script: list[dict[str, Any] | str], **kw: Any) -> list[Event]:
    """Feed chunks; DONE stands for the upstream's data: [DONE] (the translator's finish()),
    BEGIN and PING for the translator's begin() and ping()."""
    translator = Translator("client-model", **kw)
    steps = {DONE: translator.finish, BEGIN: translator.begin, PING: translator.ping}
    events: list[Event] = []
    for step in script:
        events.extend(steps[step]() if isinstance(step, str) else translator.feed(step))
    return events


def assert_pings_wait_for_message_start(events: list[Event]) -> None:
    """A strict client's rule the shared check (tests/anthropic_rules.py) leaves out: it skips
    pings wherever they are."""
    names = [name for name, _ in events]
    if "ping" in names:
        assert names[0] == "message_start", names
        assert "message_stop" not in names[:-1] and "error" not in names[:-1], names


NO_FINISH = "upstream ended the stream without a finish_reason"

PLAYBOOKS: list[Any] = [
    pytest.param(
        [role(), think("Let me"), think(" think."), say("Hi"), say(" there"), finish("stop"), DONE],
        {"input_tokens": 12},
        [
            ("message_start", 12),
            ("start", 0, "thinking"),
            ("delta", 0, "Let me"),
            ("delta", 0, " think."),
            ("stop", 0),
            ("start", 1, "text"),
            ("delta", 1, "Hi"),
            ("delta", 1, " there"),
            ("stop", 1),
            ("message_delta", "end_turn", None, 12, 4),
            ("message_stop",),
        ],
        id="reasoning then text: thinking is index 0 and closes before text index 1",
    ),
    pytest.param(
        [role(), say("Hello"), say("!"), finish("stop"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "Hello"),
            ("delta", 0, "!"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 0, 2),
            ("message_stop",),
        ],
        id="text only: text block is index 0",
    ),
    pytest.param(
        [role(), think("hmm"), think("..."), finish("length"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "thinking"),
            ("delta", 0, "hmm"),
            ("delta", 0, "..."),
            ("stop", 0),
            ("message_delta", "max_tokens", None, 0, 2),
            ("message_stop",),
        ],
        id="thinking only, cut by length: thinking closed before message_delta, max_tokens",
    ),
    pytest.param(
        [
            role(),
            say("Checking."),
            call(0, id="call_a", name="get_weather"),
            call(0, '{"city":'),
            call(0, ' "Paris"}'),
            call(1, "{}", id="call_b", name="get_time"),
            finish("tool_calls"),
            DONE,
        ],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "Checking."),
            ("stop", 0),
            ("start", 1, "tool_use"),
            ("delta", 1, '{"city":'),
            ("delta", 1, ' "Paris"}'),
            ("stop", 1),
            ("start", 2, "tool_use"),
            ("delta", 2, "{}"),
            ("stop", 2),
            ("message_delta", "tool_use", None, 0, 5),
            ("message_stop",),
        ],
        id="two tool calls, each closed before the next",
    ),
    pytest.param(
        [role(), call(0, id="call_a", name="noop"), finish("tool_calls"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "tool_use"),
            ("stop", 0),
            ("message_delta", "tool_use", None, 0, 1),
            ("message_stop",),
        ],
        id="tool call with empty arguments still starts and stops",
    ),
    pytest.param(
        [role(), call(0, "{}", id="call_a", name="noop"), finish("stop"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "tool_use"),
            ("delta", 0, "{}"),
            ("stop", 0),
            ("message_delta", "tool_use", None, 0, 1),
            ("message_stop",),
        ],
        id="finish_reason stop after tool calls reports tool_use",
    ),
    pytest.param(
        [role(), say("a"), finish("stop", stop_reason="END"), DONE],
        {"stop_sequences": ["END"]},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "stop_sequence", "END", 0, 1),
            ("message_stop",),
        ],
        id="vLLM stop_reason names a requested stop sequence",
    ),
    pytest.param(
        [role(), say("a"), finish("stop", stopping_word="###"), DONE],
        {"stop_sequences": ["###"]},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "stop_sequence", "###", 0, 1),
            ("message_stop",),
        ],
        id="llama.cpp stopping_word names a requested stop sequence",
    ),
    pytest.param(
        [role(), say("a"), finish("stop", stop_reason="<|im_end|>"), DONE],
        {"stop_sequences": ["END"]},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 0, 1),
            ("message_stop",),
        ],
        id="a stop string the client did not ask for is an end_turn",
    ),
    pytest.param(
        [role(), say("a"), finish("content_filter"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 0, 1),
            ("message_stop",),
        ],
        id="content_filter becomes end_turn",
    ),
    pytest.param(
        [role(), say("a"), finish("stop"), usage(31, 9), DONE],
        {"input_tokens": 30},
        [
            ("message_start", 30),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 31, 9),
            ("message_stop",),
        ],
        id="usage on a final choices:[] chunk wins over the estimate",
    ),
    pytest.param(
        [
            think("r", field="reasoning", usage={"prompt_tokens": 7, "completion_tokens": 1}),
            say("t", usage={"prompt_tokens": 7, "completion_tokens": 2}),
            finish("stop", usage={"prompt_tokens": 7, "completion_tokens": 2}),
            usage(7, 2),
            DONE,
        ],
        {"input_tokens": 99},
        [
            ("message_start", 7),
            ("start", 0, "thinking"),
            ("delta", 0, "r"),
            ("stop", 0),
            ("start", 1, "text"),
            ("delta", 1, "t"),
            ("stop", 1),
            ("message_delta", "end_turn", None, 7, 2),
            ("message_stop",),
        ],
        id="vLLM: reasoning field, usage on every chunk, trailing usage ignored",
    ),
    pytest.param(
        [
            role(),
            say(""),
            chunk({"content": None}),
            chunk(None),
            {"id": "x", "choices": []},
            say("a"),
            finish("stop"),
            DONE,
        ],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 0, 1),
            ("message_stop",),
        ],
        id="role-only, empty and choices:[] chunks make no blocks",
    ),
    pytest.param(
        [role(), say("a"), think("b"), say("c"), finish("stop"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("stop", 0),
            ("start", 1, "thinking"),
            ("delta", 1, "b"),
            ("stop", 1),
            ("start", 2, "text"),
            ("delta", 2, "c"),
            ("stop", 2),
            ("message_delta", "end_turn", None, 0, 3),
            ("message_stop",),
        ],
        id="reasoning after text opens a new thinking block",
    ),
    pytest.param(
        [chunk({"reasoning_content": "r", "content": "t"}, finish="stop"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "thinking"),
            ("delta", 0, "r"),
            ("stop", 0),
            ("start", 1, "text"),
            ("delta", 1, "t"),
            ("stop", 1),
            ("message_delta", "end_turn", None, 0, 1),
            ("message_stop",),
        ],
        id="reasoning, content and finish_reason in one chunk",
    ),
    pytest.param(
        [chunk({"reasoning_content": "r", "reasoning": "r"}), finish(), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "thinking"),
            ("delta", 0, "r"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 0, 1),
            ("message_stop",),
        ],
        id="both reasoning fields carry the same text once",
    ),
    pytest.param(
        [finish("stop"), DONE],
        {},
        [("message_start", 0), ("message_delta", "end_turn", None, 0, 0), ("message_stop",)],
        id="empty answer: no blocks",
    ),
    pytest.param(
        [role(), say("a"), say("b"), DONE],
        {},
        [
            ("message_start", 0),
            ("start", 0, "text"),
            ("delta", 0, "a"),
            ("delta", 0, "b"),
            ("error", "api_error", NO_FINISH),
        ],
        id="upstream ends without finish_reason: error, no message_stop",
    ),
    pytest.param(
        [DONE],
        {"input_tokens": 5},
        [("message_start", 5), ("error", "api_error", NO_FINISH)],
        id="[DONE] then nothing: message_start and an error",
    ),
    pytest.param(
        [PING, PING, role(), say("Hi"), finish("stop"), usage(1780, 1), DONE],
        {"input_tokens": 5},
        [
            ("message_start", 5),
            ("ping",),
            ("ping",),
            ("start", 0, "text"),
            ("delta", 0, "Hi"),
            ("stop", 0),
            ("message_delta", "end_turn", None, 1780, 1),
            ("message_stop",),
        ],
        id="pings before the first chunk: message_start first, the upstream's count at the end",
    ),
    pytest.param(
        [BEGIN, role(), say("Hi"), PING, finish("length"), PING, DONE],
        {"input_tokens": 5},
        [
            ("message_start", 5),
            ("start", 0, "text"),
            ("delta", 0, "Hi"),
            ("ping",),
            ("stop", 0),
            ("ping",),
            ("message_delta", "max_tokens", None, 5, 1),
            ("message_stop",),
        ],
        id="begun before the first chunk: no second message_start, pings anywhere before the end",
    ),
    pytest.param(
        [BEGIN, PING, DONE],
        {},
        [("message_start", 0), ("ping",), ("error", "api_error", NO_FINISH)],
        id="begun, then [DONE] without a chunk: the error alone after what is out",
    ),
]


@pytest.mark.parametrize(("script", "options", "expected"), PLAYBOOKS)
def test_playbook(
    script: list[Any], options: dict[str, Any], expected: list[tuple[Any, ...]]
) -> None:
    events = play(script, **options)
    assert [short(e) for e in events] == expected
    assert_valid_anthropic_stream(events)
    assert_pings_wait_for_message_start(events)


def test_message_start_envelope() -> None:
    translator = Translator("my-alias", input_tokens=3, message_id="msg_fixed")
    [(name, payload), *_] = translator.feed(role())
    assert name == "message_start"
    assert payload == {
        "type": "message_start",
        "message": {
            "id": "msg_fixed",
            "type": "message",
            "role": "assistant",
            "model": "my-alias",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 3, "output_tokens": 0},
        },
    }


def test_begin_sends_message_start_now_and_no_chunk_sends_another() -> None:
    translator = Translator("my-alias", input_tokens=3, message_id="msg_fixed")
    [(name, payload)] = translator.begin()
    assert name == "message_start" and payload["message"]["id"] == "msg_fixed"
    assert payload["message"]["usage"] == {"input_tokens": 3, "output_tokens": 0}
    assert translator.state is State.STREAMING and not translator.done
    assert [short(e) for e in translator.feed(say("a"))] == [
        ("start", 0, "text"), ("delta", 0, "a")]


def test_begin_with_a_count_says_it_until_the_upstream_says_its_own() -> None:
    translator = Translator("m", input_tokens=3)
    assert short(translator.begin(input_tokens=40)[0]) == ("message_start", 40)
    assert translator.input_tokens == 40
    events = translator.feed(say("a")) + translator.feed(finish()) + translator.finish()
    assert short(events[-2]) == ("message_delta", "end_turn", None, 40, 1)  # no upstream count


def test_the_sdk_takes_the_upstreams_prompt_count_from_message_delta_over_message_start() -> None:
    translator = Translator("client-model", input_tokens=7)
    events = translator.begin() + translator.ping()
    events += translator.feed(role()) + translator.feed(say("Hi")) + translator.feed(finish())
    events += translator.feed(usage(1780, 1)) + translator.finish()
    assert events[0][1]["message"]["usage"]["input_tokens"] == 7
    assert events[-2][1]["usage"] == {"input_tokens": 1780, "output_tokens": 1}
    client = _sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        kinds = [event.type for event in stream]
        message = stream.get_final_message()
    assert kinds[0] == "message_start" and "ping" not in kinds  # the SDK skips pings
    assert (message.usage.input_tokens, message.usage.output_tokens) == (1780, 1)
    assert message.content[0].text == "Hi"  # type: ignore[union-attr]


def test_the_prompts_cached_part_is_cache_read_input_tokens_in_message_delta() -> None:
    """llama-server's usage chunk (its prompt_tokens_details and timings: 903 of 917 cached):
    message_start counts the whole prompt, message_delta splits it the way Anthropic does, and
    the SDK's message ends with both."""
    warm = usage(917, 1)
    warm["usage"]["prompt_tokens_details"] = {"cached_tokens": 903}
    warm["timings"] = {"cache_n": 903, "prompt_n": 14}
    translator = Translator("client-model", input_tokens=917)
    events = translator.begin() + translator.feed(role()) + translator.feed(say("Hi"))
    events += translator.feed(finish("length")) + translator.feed(warm) + translator.finish()
    assert events[0][1]["message"]["usage"] == {"input_tokens": 917, "output_tokens": 0}
    assert events[-2][1]["usage"] == {"input_tokens": 14, "cache_read_input_tokens": 903,
                                      "output_tokens": 1}
    client = _sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert (message.usage.input_tokens, message.usage.cache_read_input_tokens) == (14, 903)


def test_timings_alone_say_the_cached_part_and_silence_says_none() -> None:
    """llama-server without include_usage: its timings on the finish chunk; an upstream that
    says nothing of a cache gets no cache_read_input_tokens (not a 0 it did not say)."""
    timed = finish("stop") | {"timings": {"cache_n": 903, "prompt_n": 14}}
    events = play([role(), say("Hi"), timed, DONE], input_tokens=917)
    assert events[-2][1]["usage"] == {"input_tokens": 14, "cache_read_input_tokens": 903,
                                      "output_tokens": 1}
    events = play([role(), say("Hi"), finish("stop"), DONE], input_tokens=917)
    assert events[-2][1]["usage"] == {"input_tokens": 917, "output_tokens": 1}


def test_generated_ids() -> None:
    events = play([role(), call(0, "{}", name="f"), finish("tool_calls"), DONE])
    message_id = events[0][1]["message"]["id"]
    tool_id = events[1][1]["content_block"]["id"]
    assert message_id.startswith("msg_") and len(message_id) == 28
    assert tool_id.startswith("toolu_") and len(tool_id) > 10


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


def test_tool_calls_keyed_by_id_when_index_is_missing() -> None:
    def entry(**kw: Any) -> dict[str, Any]:
        return chunk({"tool_calls": [kw]})

    events = play(
        [
            entry(id="c1", function={"name": "f", "arguments": "{"}),
            entry(function={"arguments": "}"}),
            entry(id="c2", function={"name": "g", "arguments": "{}"}),
            finish("tool_calls"),
            DONE,
        ]
    )
    assert [short(e) for e in events][1:-2] == [
        ("start", 0, "tool_use"),
        ("delta", 0, "{"),
        ("delta", 0, "}"),
        ("stop", 0),
        ("start", 1, "tool_use"),
        ("delta", 1, "{}"),
        ("stop", 1),
    ]


def test_several_tool_calls_in_one_chunk() -> None:
    both = chunk(
        {
            "tool_calls": [
                {"index": 0, "id": "a", "function": {"name": "f", "arguments": "{}"}},
                {"index": 1, "id": "b", "function": {"name": "g", "arguments": "{}"}},
            ]
        }
    )
    events = play([both, finish("tool_calls"), DONE])
    assert [short(e) for e in events][1:-2] == [
        ("start", 0, "tool_use"),
        ("delta", 0, "{}"),
        ("stop", 0),
        ("start", 1, "tool_use"),
        ("delta", 1, "{}"),
        ("stop", 1),
    ]
    message = assemble(events)
    assert [(b["id"], b["name"], b["input"]) for b in message["content"]] == [
        ("a", "f", {}),
        ("b", "g", {}),
    ]


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


def run_pipeline(pieces: list[bytes], **options: Any) -> list[Event]:
    """What the relay does: decode reads, translate each data: frame, [DONE] or EOF finishes."""
    decoder = Decoder()
    translator = Translator("client-model", **options)
    events: list[Event] = []
    for piece in pieces:
        for sse in decoder.feed(piece):
            if translator.state is State.CLOSED or translator.state is State.FAILED:
                continue
            if sse.data == "[DONE]":
                events += translator.finish()
                continue
            try:
                events += translator.feed(orjson.loads(sse.data))
            except (orjson.JSONDecodeError, MalformedChunk) as exc:
                events += translator.fail(f"bad upstream chunk: {exc}")
    decoder.close()
    if not translator.done or translator.state is State.DONE:
        events += translator.finish()
    return events


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


def _sdk_client(body: bytes) -> anthropic.Anthropic:
    # The SDK is imported by the two tests that use it: it would cost every collection ~1 s.
    import anthropic

    try:
        import httpx2 as httpx
    except ModuleNotFoundError:  # the SDK built on httpx before it moved to httpx2
        import httpx  # type: ignore[no-redef,import-not-found,unused-ignore]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    return anthropic.Anthropic(
        api_key="test",
        base_url="http://hal0d.test",
        max_retries=0,
        http_client=httpx.Client(transport=httpx.MockTransport(handler)),
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
    client = _sdk_client(encode_events(events))
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
    client = _sdk_client(encode_events(events))
    request = client.messages.stream(
        model="m", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    )
    with pytest.raises(anthropic.APIStatusError, match="upstream went away"), request as stream:
        stream.get_final_message()


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
    request = _sdk_client(out).messages.stream(
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


def test_the_sdk_reads_pings_anywhere_in_the_stream_as_nothing() -> None:
    events = play([PING, role(), say("Hi"), PING, say("!"), finish(), PING, usage(4, 2), DONE],
                  input_tokens=4)
    client = _sdk_client(encode_events(events))
    with client.messages.stream(
        model="client-model", max_tokens=8, messages=[{"role": "user", "content": "hi"}]
    ) as stream:
        message = stream.get_final_message()
    assert message.content[0].text == "Hi!"  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


# --- property: any read boundaries give the same, valid stream ----------------------------------

fragment = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=4)
segment = st.one_of(
    st.tuples(st.just("reasoning"), st.lists(fragment, min_size=1, max_size=3)),
    st.tuples(st.just("text"), st.lists(fragment, min_size=1, max_size=3)),
    st.tuples(st.just("tool"), st.lists(fragment, max_size=3)),
)


@st.composite
def upstream_streams(draw: st.DrawFn) -> tuple[bytes, list[dict[str, Any]]]:
    segments = draw(st.lists(segment, max_size=5))
    reasoning_field = draw(st.sampled_from(["reasoning_content", "reasoning"]))
    usage_mode = draw(st.sampled_from(["none", "trailing", "continuous"]))
    eol = draw(st.sampled_from([b"\n", b"\r\n", b"\r"]))
    chunks: list[dict[str, Any]] = [role()]
    expected: list[dict[str, Any]] = []
    tools = 0
    for kind, parts in segments:
        if kind == "tool":
            chunks.append(call(tools, id=f"call_{tools}", name=f"tool_{tools}"))
            tool_input = {"q": "".join(parts)} if parts else {}
            arguments = orjson.dumps(tool_input).decode() if parts else ""
            step = max(1, len(arguments) // max(1, len(parts)))
            chunks.extend(
                call(tools, arguments[i : i + step]) for i in range(0, len(arguments), step)
            )
            expected.append(
                {
                    "type": "tool_use",
                    "id": f"call_{tools}",
                    "name": f"tool_{tools}",
                    "input": tool_input,
                }
            )
            tools += 1
            continue
        for part in parts:
            chunks.append(think(part, field=reasoning_field) if kind == "reasoning" else say(part))
        key = "thinking" if kind == "reasoning" else "text"
        if expected and expected[-1]["type"] == key:
            expected[-1][key] += "".join(parts)
        else:
            expected.append({"type": key, key: "".join(parts)})
    chunks.append(finish(draw(st.sampled_from(["stop", "length", "tool_calls"]))))
    if usage_mode == "continuous":
        for n, c in enumerate(chunks):
            c["usage"] = {"prompt_tokens": 5, "completion_tokens": n}
    elif usage_mode == "trailing":
        chunks.append(usage(5, len(chunks)))
    frames = [b"data: " + orjson.dumps(c) + eol + eol for c in chunks]
    if draw(st.booleans()):
        frames.insert(draw(st.integers(0, len(frames))), b": keepalive" + eol + eol)
    raw = b"".join(frames) + b"data: [DONE]" + eol + eol
    return raw, expected


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
