"""Anthropic Messages requests in, OpenAI chat requests out: the translation as a table, the
tool choice, max_tokens clamped to the slot, what the parsed request carries and the prompt's
text. Bad bodies are tested in test_anthropic_request_invalid.py."""

from __future__ import annotations

from typing import Any

import pytest

from hal0d.anthropic.request import parse_messages_request, prompt_text, to_openai
from tests.harness.anthropic_request import body


def translate(raw: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return to_openai(parse_messages_request(raw), served_model="served", **kw)


TOOL_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}

TRANSLATIONS: list[Any] = [
    pytest.param(
        body(),
        {"model": "served", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]},
        id="minimal",
    ),
    pytest.param(
        body(
            system="Be brief.",
            stop_sequences=["END"],
            temperature=0.2,
            top_p=0.9,
            top_k=40,
            metadata={"user_id": "u-1"},
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "stop": ["END"],
            "temperature": 0.2,
            "top_p": 0.9,
            "top_k": 40,
            "user": "u-1",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
            ],
        },
        id="system string and sampling parameters",
    ),
    pytest.param(
        body(
            system=[
                {"type": "text", "text": "One."},
                {"type": "text", "text": "Two.", "cache_control": {"type": "ephemeral"}},
            ],
            messages=[
                {"role": "system", "content": "Three."},
                {"role": "user", "content": "hi"},
                {"role": "system", "content": [{"type": "text", "text": "Four."}]},
            ],
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [
                {"role": "system", "content": "One.\nTwo.\nThree.\nFour."},
                {"role": "user", "content": "hi"},
            ],
        },
        id="system blocks and role system messages fold into one leading system prompt",
    ),
    pytest.param(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "x", "signature": "s"},
                        {"type": "redacted_thinking", "data": "zz"},
                        {"type": "text", "text": "c"},
                    ],
                },
            ]
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [
                {"role": "user", "content": "a\nb"},
                {"role": "assistant", "content": "c"},
            ],
        },
        id="text blocks join into a string; thinking in history is dropped",
    ),
    pytest.param(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": "iVBORw0KGgo=",
                            },
                        },
                        {
                            "type": "image",
                            "source": {"type": "url", "url": "https://example.test/cat.jpg"},
                        },
                    ],
                }
            ]
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {
                            "type": "image_url",
                            "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="},
                        },
                        {"type": "image_url", "image_url": {"url": "https://example.test/cat.jpg"}},
                    ],
                }
            ],
        },
        id="images make a content-part list",
    ),
    pytest.param(
        body(
            tools=[
                {"name": "get_weather", "description": "Weather now", "input_schema": TOOL_SCHEMA},
                {
                    "name": "noop",
                    "input_schema": {"type": "object"},
                    "cache_control": {"type": "ephemeral"},
                },
            ],
            tool_choice={"type": "auto"},
            messages=[
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Checking."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "get_weather",
                            "input": {"city": "Paris"},
                        },
                        {"type": "tool_use", "id": "toolu_2", "name": "noop", "input": {}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "Here you go."},
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [
                                {"type": "text", "text": "ok"},
                                {"type": "image", "source": {}},
                                {"type": "text", "text": "done"},
                            ],
                        },
                        {"type": "tool_result", "tool_use_id": "toolu_3", "is_error": True},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_4", "name": "noop", "input": {}}],
                },
            ],
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "description": "Weather now",
                        "parameters": TOOL_SCHEMA,
                    },
                },
                {
                    "type": "function",
                    "function": {"name": "noop", "parameters": {"type": "object"}},
                },
            ],
            "tool_choice": "auto",
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": "Checking.",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
                        },
                        {
                            "id": "toolu_2",
                            "type": "function",
                            "function": {"name": "noop", "arguments": "{}"},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "18C"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "ok\ndone"},
                {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
                {"role": "user", "content": "Here you go."},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "toolu_4",
                            "type": "function",
                            "function": {"name": "noop", "arguments": "{}"},
                        }
                    ],
                },
            ],
        },
        id="tools, tool_use and tool_result (tool messages before the user's text)",
    ),
    pytest.param(
        body(
            messages=[
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "x"}],
                }
            ]
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [{"role": "tool", "tool_call_id": "t", "content": "x"}],
        },
        id="a user message of only tool results adds no empty user message",
    ),
    pytest.param(
        body(
            tools=[{"name": "f", "input_schema": {}}],
            tool_choice={"type": "tool", "name": "f", "disable_parallel_tool_use": True},
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "parallel_tool_calls": False,
        },
        id="tool_choice tool, parallel calls disabled",
    ),
    pytest.param(
        body(
            stream=True, thinking={"type": "enabled", "budget_tokens": 1024}, unknown_future_field=1
        ),
        {
            "model": "served",
            "max_tokens": 64,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
        id="stream asks for usage; unknown top-level keys are ignored",
    ),
]


@pytest.mark.parametrize(("raw", "expected"), TRANSLATIONS)
def test_translation(raw: dict[str, Any], expected: dict[str, Any]) -> None:
    assert translate(raw) == expected


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "X"}, {"type": "function", "function": {"name": "X"}}),
    ],
)
def test_tool_choice(choice: dict[str, Any], expected: Any) -> None:
    assert translate(body(tool_choice=choice))["tool_choice"] == expected


@pytest.mark.parametrize(("requested", "cap", "sent"), [(64, None, 64), (64, 32, 32), (16, 32, 16)])
def test_max_tokens_clamped_to_the_slot(requested: int, cap: int | None, sent: int) -> None:
    assert translate(body(max_tokens=requested), max_output_tokens=cap)["max_tokens"] == sent


def test_parsed_request_carries_what_the_handler_needs() -> None:
    req = parse_messages_request(body(stream=True, stop_sequences=["a", "b"]))
    assert (req.model, req.stream, req.stop_sequences, req.max_tokens) == (
        "claude-alias",
        True,
        ("a", "b"),
        64,
    )
    assert parse_messages_request(body()).stream is False


def test_prompt_text_covers_every_message_and_tool() -> None:
    request = translate(
        body(
            system="SYS",
            tools=[{"name": "lookup", "description": "DESC", "input_schema": {"type": "object"}}],
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "U1"},
                        {"type": "image", "source": {"type": "url", "url": "http://x"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "A1"},
                        {"type": "tool_use", "id": "t", "name": "lookup", "input": {"k": "V"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "t", "content": "R1"}],
                },
            ],
        )
    )
    text = prompt_text(request)
    for piece in ("SYS", "U1", "A1", "lookup", '{"k":"V"}', "R1", "DESC", '"object"'):
        assert piece in text
    assert "http://x" not in text
