"""Anthropic Messages requests in, OpenAI chat requests out; bad bodies name their field."""

from __future__ import annotations

from typing import Any

import pytest

from hal0d.anthropic.request import parse_messages_request, prompt_text, to_openai
from hal0d.errors import InvalidRequest


def body(**overrides: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "model": "claude-alias",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    out.update(overrides)
    return out


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


def msgs(*content: Any, role: str = "user") -> list[dict[str, Any]]:
    return [{"role": role, "content": list(content)}]


INVALID: list[Any] = [
    pytest.param([1], None, id="body not an object"),
    pytest.param({"max_tokens": 1, "messages": msgs()}, "model", id="model missing"),
    pytest.param(body(model=5), "model", id="model not a string"),
    pytest.param({"model": "m", "messages": msgs()}, "max_tokens", id="max_tokens missing"),
    pytest.param(body(max_tokens=0), "max_tokens", id="max_tokens zero"),
    pytest.param(body(max_tokens=-3), "max_tokens", id="max_tokens negative"),
    pytest.param(body(max_tokens=1.5), "max_tokens", id="max_tokens float"),
    pytest.param(body(max_tokens=True), "max_tokens", id="max_tokens bool"),
    pytest.param(body(max_tokens="64"), "max_tokens", id="max_tokens string"),
    pytest.param(body(max_tokens=1_000_001), "max_tokens", id="max_tokens absurd"),
    pytest.param({"model": "m", "max_tokens": 1}, "messages", id="messages missing"),
    pytest.param(body(messages={"role": "user"}), "messages", id="messages not a list"),
    pytest.param(body(messages=[]), "messages", id="messages empty"),
    pytest.param(
        body(messages=[{"role": "user", "content": "x"}] * 100_001),
        "messages",
        id="too many messages",
    ),
    pytest.param(body(messages=["hi"]), "messages.0", id="message not an object"),
    pytest.param(
        body(messages=[{"role": "tool", "content": "x"}]), "messages.0.role", id="role unknown"
    ),
    pytest.param(body(messages=[{"content": "x"}]), "messages.0.role", id="role missing"),
    pytest.param(body(messages=[{"role": "user"}]), "messages.0.content", id="content missing"),
    pytest.param(
        body(messages=[{"role": "user", "content": 5}]), "messages.0.content", id="content a number"
    ),
    pytest.param(body(messages=msgs("x")), "messages.0.content.0", id="block not an object"),
    pytest.param(
        body(messages=msgs({"text": "x"})), "messages.0.content.0.type", id="block type missing"
    ),
    pytest.param(
        body(messages=msgs({"type": "video"})), "messages.0.content.0.type", id="unknown block type"
    ),
    pytest.param(
        body(messages=msgs({"type": "text", "text": 1})),
        "messages.0.content.0.text",
        id="text not a string",
    ),
    pytest.param(
        body(
            messages=msgs(
                {"type": "text", "text": "a"},
                {"type": "image", "source": {"type": "file", "file_id": "f"}},
            )
        ),
        "messages.0.content.1.source.type",
        id="image source type unsupported",
    ),
    pytest.param(
        body(messages=msgs({"type": "image", "source": {"type": "base64", "data": "x"}})),
        "messages.0.content.0.source.media_type",
        id="image media_type missing",
    ),
    pytest.param(
        body(messages=msgs({"type": "image", "source": {"type": "url"}})),
        "messages.0.content.0.source.url",
        id="image url missing",
    ),
    pytest.param(
        body(messages=msgs({"type": "tool_use", "id": "t", "name": "f", "input": {}})),
        "messages.0.content.0.type",
        id="tool_use in a user message",
    ),
    pytest.param(
        body(
            messages=msgs(
                {"type": "tool_use", "id": "t", "name": "f", "input": []}, role="assistant"
            )
        ),
        "messages.0.content.0.input",
        id="tool_use input not an object",
    ),
    pytest.param(
        body(messages=msgs({"type": "tool_use", "name": "f", "input": {}}, role="assistant")),
        "messages.0.content.0.id",
        id="tool_use id missing",
    ),
    pytest.param(
        body(messages=msgs({"type": "tool_result", "content": "x"})),
        "messages.0.content.0.tool_use_id",
        id="tool_result id missing",
    ),
    pytest.param(
        body(messages=msgs({"type": "tool_result", "tool_use_id": "t", "content": 3})),
        "messages.0.content.0.content",
        id="tool_result content a number",
    ),
    pytest.param(
        body(
            messages=msgs(
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}
            )
        ),
        "messages.0.content.0.content.0.type",
        id="tool_result inner block unsupported",
    ),
    pytest.param(
        body(messages=msgs({"type": "tool_result", "tool_use_id": "t"}, role="assistant")),
        "messages.0.content.0.type",
        id="tool_result in an assistant message",
    ),
    pytest.param(
        body(messages=[{"role": "system", "content": [{"type": "image"}]}]),
        "messages.0.content.0.type",
        id="system message with an image",
    ),
    pytest.param(body(system=5), "system", id="system a number"),
    pytest.param(body(system=[{"type": "image"}]), "system.0.type", id="system block not text"),
    pytest.param(body(stream="yes"), "stream", id="stream not a bool"),
    pytest.param(body(temperature="hot"), "temperature", id="temperature a string"),
    pytest.param(body(temperature=True), "temperature", id="temperature a bool"),
    pytest.param(body(top_p=[1]), "top_p", id="top_p a list"),
    pytest.param(body(top_k=0.5), "top_k", id="top_k a float"),
    pytest.param(body(stop_sequences="END"), "stop_sequences", id="stop_sequences a string"),
    pytest.param(
        body(stop_sequences=["a", 1]), "stop_sequences.1", id="stop_sequences item not a string"
    ),
    pytest.param(body(tools={"name": "f"}), "tools", id="tools not a list"),
    pytest.param(body(tools=["f"]), "tools.0", id="tool not an object"),
    pytest.param(body(tools=[{"input_schema": {}}]), "tools.0.name", id="tool name missing"),
    pytest.param(
        body(tools=[{"name": "f"}]), "tools.0.input_schema", id="tool input_schema missing"
    ),
    pytest.param(
        body(tools=[{"name": "f", "input_schema": {}, "description": 3}]),
        "tools.0.description",
        id="tool description not a string",
    ),
    pytest.param(
        body(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
        "tools.0.type",
        id="server tool",
    ),
    pytest.param(body(tool_choice="auto"), "tool_choice", id="tool_choice a string"),
    pytest.param(
        body(tool_choice={"type": "sometimes"}), "tool_choice.type", id="tool_choice type unknown"
    ),
    pytest.param(
        body(tool_choice={"type": "tool"}), "tool_choice.name", id="tool_choice tool without name"
    ),
    pytest.param(
        body(tool_choice={"type": "auto", "disable_parallel_tool_use": "no"}),
        "tool_choice.disable_parallel_tool_use",
        id="disable_parallel_tool_use not a bool",
    ),
    pytest.param(body(metadata="x"), "metadata", id="metadata not an object"),
    pytest.param(
        body(metadata={"user_id": 5}), "metadata.user_id", id="metadata.user_id not a string"
    ),
]


@pytest.mark.parametrize(("raw", "field"), INVALID)
def test_invalid_body_names_the_field(raw: Any, field: str | None) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_messages_request(raw)
    assert caught.value.field == field
    assert caught.value.status == 400
    if field is not None:
        assert caught.value.message.startswith(f"{field}: ")
