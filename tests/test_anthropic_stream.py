"""The streaming translator as playbooks: OpenAI chunks in, Anthropic events out, tool calls too.

Events are written in a short form (see `short` in tests/harness/anthropic_stream.py) so each case
reads as the stream a client sees. The message a stream makes (its envelope, ids and counts) is
tested in test_anthropic_stream_message.py, the translator's states and failures in
test_anthropic_stream_errors.py, its frames on the wire and the SDK reading them in
test_anthropic_stream_wire.py, and the transform around it in test_anthropic_stream_transform.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.anthropic_rules import assemble, assert_valid_anthropic_stream
from tests.harness.anthropic_stream import (
    BEGIN,
    DONE,
    PING,
    assert_pings_wait_for_message_start,
    call,
    chunk,
    finish,
    play,
    role,
    say,
    short,
    think,
    usage,
)

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
