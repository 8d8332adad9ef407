"""Bad Anthropic Messages request bodies are refused (InvalidRequest, 400) naming their field, as
a dotted path into the body: a table of them."""

from __future__ import annotations

from typing import Any

import pytest

from hal0d.anthropic.request import parse_messages_request
from hal0d.errors import InvalidRequest
from tests.harness.anthropic_request import body


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
