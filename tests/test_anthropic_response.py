"""Non-streaming: an OpenAI chat.completion in, an Anthropic Messages response out."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from hal0d.anthropic.response import to_anthropic
from hal0d.errors import UpstreamUnavailable
from tests.fixtures_util import fixture_path


def completion(
    message: dict[str, Any],
    finish: str | None = "stop",
    usage: dict[str, int] | None = None,
    **choice: Any,
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "served",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", **message},
                "finish_reason": finish,
                **choice,
            }
        ],
    }
    if usage is not None:
        out["usage"] = usage
    return out


def tool_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


CASES: list[Any] = [
    pytest.param(
        completion({"content": "Hi"}, usage={"prompt_tokens": 5, "completion_tokens": 2}),
        {},
        {
            "content": [{"type": "text", "text": "Hi"}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 2},
        },
        id="text",
    ),
    pytest.param(
        completion({"reasoning_content": "Think.", "content": "Answer."}, "length"),
        {},
        {
            "content": [
                {"type": "thinking", "thinking": "Think.", "signature": ""},
                {"type": "text", "text": "Answer."},
            ],
            "stop_reason": "max_tokens",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        id="reasoning_content then text, length",
    ),
    pytest.param(
        completion({"reasoning": "Think.", "content": None}),
        {},
        {
            "content": [{"type": "thinking", "thinking": "Think.", "signature": ""}],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        id="vLLM reasoning field",
    ),
    pytest.param(
        completion(
            {
                "content": "Let me check.",
                "tool_calls": [
                    tool_call("call_1", "get_weather", '{"city": "Paris"}'),
                    tool_call("call_2", "broken", '{"city": '),
                    tool_call("call_3", "parsed", {"already": True}),
                    tool_call("call_4", "empty", ""),
                ],
            },
            "tool_calls",
        ),
        {},
        {
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
                {
                    "type": "tool_use",
                    "id": "call_2",
                    "name": "broken",
                    "input": {"_raw": '{"city": '},
                },
                {"type": "tool_use", "id": "call_3", "name": "parsed", "input": {"already": True}},
                {"type": "tool_use", "id": "call_4", "name": "empty", "input": {}},
            ],
            "stop_reason": "tool_use",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        id="tool calls: parsed, unparsable kept raw, pre-parsed, empty",
    ),
    pytest.param(
        completion({"content": "a"}, "stop", stop_reason="END"),
        {"stop_sequences": ["END"]},
        {
            "content": [{"type": "text", "text": "a"}],
            "stop_reason": "stop_sequence",
            "stop_sequence": "END",
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        id="matched stop sequence",
    ),
    pytest.param(
        completion({"content": ""}, "stop"),
        {},
        {
            "content": [],
            "stop_reason": "end_turn",
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        },
        id="empty answer",
    ),
]


@pytest.mark.parametrize(("response", "options", "expected"), CASES)
def test_translation(
    response: dict[str, Any], options: dict[str, Any], expected: dict[str, Any]
) -> None:
    out = to_anthropic(response, model="client-model", message_id="msg_1", **options)
    assert out == {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "client-model",
        **expected,
    }


def test_generated_ids() -> None:
    out = to_anthropic(
        completion({"tool_calls": [tool_call(None, "f", "{}")]}, "tool_calls"), model="m"
    )
    assert out["id"].startswith("msg_")
    assert out["content"][0]["id"].startswith("toolu_")


def test_llama_cpp_python_capture() -> None:
    raw = orjson.loads(fixture_path("llama-cpp-python-0.3.36-smollm2-nonstream.json").read_bytes())
    out = to_anthropic(raw, model="smol")
    assert out["content"] == [
        {"type": "text", "text": "Hello, welcome to my little corner of the world!"}
    ]
    assert (out["stop_reason"], out["usage"]) == (
        "end_turn",
        {"input_tokens": 36, "output_tokens": 11},
    )


@pytest.mark.parametrize(("capture", "usage"), [
    ("chat-warm", {"input_tokens": 14, "cache_read_input_tokens": 903, "output_tokens": 4}),
    ("chat-cold", {"input_tokens": 900, "cache_read_input_tokens": 0, "output_tokens": 4}),
])
def test_llama_server_captures_say_the_cached_part_as_cache_read_input_tokens(
    capture: str, usage: dict[str, int]
) -> None:
    """Anthropic's input_tokens is the prompt beyond the cache: 917 tokens of which 903 cached
    are 14 read."""
    raw = orjson.loads(fixture_path(f"llama-server/{capture}.json").read_bytes())
    assert to_anthropic(raw, model="smol")["usage"] == usage


@pytest.mark.parametrize(("given", "usage"), [
    pytest.param({"usage": {"prompt_tokens": 917, "completion_tokens": 4},
                  "timings": {"cache_n": 903, "prompt_n": 14}},
                 {"input_tokens": 14, "cache_read_input_tokens": 903, "output_tokens": 4},
                 id="timings alone"),
    pytest.param({"timings": {"cache_n": 903, "prompt_n": 14}},
                 {"input_tokens": 14, "cache_read_input_tokens": 903, "output_tokens": 0},
                 id="timings, no usage: the prompt is cache_n + prompt_n"),
    pytest.param({"usage": {"prompt_tokens": 917, "completion_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": 900}},
                  "timings": {"cache_n": 903, "prompt_n": 14}},
                 {"input_tokens": 17, "cache_read_input_tokens": 900, "output_tokens": 4},
                 id="usage and timings: the usage's figure"),
    pytest.param({"usage": {"prompt_tokens": 917, "completion_tokens": 4,
                            "prompt_tokens_details": {"cached_tokens": "many"}},
                  "timings": {"cache_n": 903, "prompt_n": 14}},
                 {"input_tokens": 14, "cache_read_input_tokens": 903, "output_tokens": 4},
                 id="a usage figure that is no count is none: the timings'"),
])
def test_the_cached_part_comes_from_usage_or_timings(
    given: dict[str, Any], usage: dict[str, int]
) -> None:
    response = {**completion({"content": "Hi"}), **given}
    assert to_anthropic(response, model="m")["usage"] == usage


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param([], id="not an object"),
        pytest.param({"choices": []}, id="no choices"),
        pytest.param({"error": {"message": "x"}}, id="error body"),
        pytest.param({"choices": [{"text": "legacy"}]}, id="no message"),
        pytest.param(completion({"content": 5}), id="content not a string"),
        pytest.param(
            completion({"tool_calls": [{"function": {"arguments": "{}"}}]}),
            id="tool call without name",
        ),
        pytest.param(completion({"tool_calls": {"x": 1}}), id="tool_calls not a list"),
    ],
)
def test_malformed_upstream_body_is_a_502(bad: Any) -> None:
    with pytest.raises(UpstreamUnavailable) as caught:
        to_anthropic(bad, model="m")
    assert caught.value.status == 502
