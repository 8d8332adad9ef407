"""The official anthropic Python SDK drives hal0d's Anthropic surface over real sockets.

hal0d sits in front of the stub upstream; the SDK is pointed at `<hal0d>/llm` exactly as a user
would point it (it appends /v1/messages itself). What the SDK ends up with is compared to what the
stub generated (hal0d_stub.models.REASONING_TEXT / CONTENT_TEXT), not to anything hal0d computed.

The SDK is imported where it is used, not at the top: importing it costs about a second, which
every `pytest` run would pay at collection, whichever tests it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import pytest
from aiohttp.test_utils import TestServer

from hal0d.config import ServerConfig
from hal0d_stub.models import CONTENT_TEXT, LONG_WORDS, REASONING_TEXT, words
from hal0d_stub.prompt import prompt_tokens
from tests.harness.config import make_config
from tests.harness.stubs import Stub

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

HI = [{"role": "user", "content": "hi"}]
WEATHER_TOOL = {
    "name": "lookup",
    "description": "Look something up.",
    "input_schema": {
        "type": "object",
        "properties": {"query": {"type": "string"}},
        "required": ["query"],
    },
}


@pytest.fixture
async def client(hal0d: TestServer) -> AsyncIterator[AsyncAnthropic]:
    from anthropic import AsyncAnthropic

    async with AsyncAnthropic(
        base_url=str(hal0d.make_url("/llm")), api_key="x", max_retries=0, timeout=10.0
    ) as sdk:
        yield sdk


async def stream_final(client: AsyncAnthropic, **params: Any) -> tuple[list[Any], Any]:
    """Every event the SDK yields, and the message it accumulated."""
    async with client.messages.stream(**params) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_message()
    return events, final


def prompt_of(usage: Any) -> int:
    """The whole prompt of an Anthropic usage: what the model read and what came from the
    upstream's prompt cache."""
    return int(usage.input_tokens + (usage.cache_read_input_tokens or 0))


def blocks(message: Any) -> list[dict[str, Any]]:
    """Content blocks without the random ids, for comparing two answers to the same request."""
    out = []
    for block in message.content:
        data = block.model_dump(exclude_none=True)
        data.pop("id", None)
        out.append(data)
    return out


async def test_sdk_base_url_under_llm_posts_to_llm_v1_messages(client: AsyncAnthropic) -> None:
    raw = await client.messages.with_raw_response.create(
        model="chat", max_tokens=64, messages=HI
    )
    assert raw.http_request.url.path == "/llm/v1/messages"
    assert raw.status_code == 200
    message = await raw.parse()
    assert [b.type for b in message.content] == ["text"]


async def test_sdk_stream_accumulates_thinking_then_text_equal_to_upstream(
    client: AsyncAnthropic,
) -> None:
    events, final = await stream_final(client, model="reasoning", max_tokens=64, messages=HI)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING_TEXT
    assert final.content[1].text == CONTENT_TEXT
    assert final.stop_reason == "end_turn"
    assert final.stop_sequence is None
    assert final.role == "assistant" and final.model == "reasoning"
    assert final.id.startswith("msg_")
    assert final.usage.output_tokens == len(words(REASONING_TEXT)) + len(words(CONTENT_TEXT))
    assert events[0].type == "message_start"
    assert events[-1].type == "message_stop"


async def test_sdk_stream_chat_only_is_one_text_block(client: AsyncAnthropic) -> None:
    _, final = await stream_final(client, model="chat", max_tokens=64, messages=HI)
    assert [b.type for b in final.content] == ["text"]
    assert final.content[0].text == CONTENT_TEXT
    assert final.stop_reason == "end_turn"
    assert final.usage.output_tokens == len(words(CONTENT_TEXT))


async def test_sdk_stream_think_only_is_one_closed_thinking_block(
    client: AsyncAnthropic,
) -> None:
    events, final = await stream_final(client, model="think-only", max_tokens=64, messages=HI)
    assert [b.type for b in final.content] == ["thinking"]
    assert final.content[0].thinking == REASONING_TEXT
    assert final.stop_reason == "end_turn"
    kinds = [e.type for e in events]
    assert kinds.index("content_block_stop") < kinds.index("message_delta")


async def test_sdk_stream_tool_call_is_tool_use_block_with_parsed_input(
    client: AsyncAnthropic,
) -> None:
    _, final = await stream_final(
        client,
        model="tool",
        max_tokens=64,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
    )
    assert [b.type for b in final.content] == ["tool_use"]
    tool = final.content[0]
    assert tool.name == "lookup"
    assert tool.input == {"query": "weather in Paris"}
    assert tool.id
    assert final.stop_reason == "tool_use"


async def test_sdk_stream_cut_by_max_tokens_says_max_tokens(client: AsyncAnthropic) -> None:
    max_tokens = 20
    _, final = await stream_final(
        client, model="reasoning", max_tokens=max_tokens,
        messages=[{"role": "user", "content": "long"}],
    )
    reasoning = words(REASONING_TEXT)
    content_words = max_tokens - len(reasoning)
    cycle = words(" ".join(LONG_WORDS))
    expected_text = "".join((cycle * 3)[:content_words])
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING_TEXT
    assert final.content[1].text == expected_text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == max_tokens


async def test_sdk_stream_raises_on_upstream_reset_instead_of_returning_truncated(
    client: AsyncAnthropic,
) -> None:
    import anthropic

    seen: list[str] = []
    with pytest.raises(anthropic.APIStatusError) as raised:
        async with client.messages.stream(model="broken", max_tokens=64, messages=HI) as stream:
            async for event in stream:
                seen.append(event.type)
    assert raised.value.body["type"] == "error"  # type: ignore[index]
    assert raised.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "broke" in raised.value.body["error"]["message"]  # type: ignore[index]
    assert seen[0] == "message_start"
    assert "content_block_delta" in seen  # the stub sent 3 tokens before the reset
    assert "message_delta" not in seen and "message_stop" not in seen


@pytest.mark.parametrize(
    ("model", "content", "max_tokens"),
    [
        ("reasoning", "hi", 64),
        ("chat", "hi", 64),
        ("think-only", "hi", 64),
        ("reasoning", "long", 20),
    ],
)
async def test_sdk_create_non_streaming_equals_the_accumulated_stream(
    client: AsyncAnthropic, model: str, content: str, max_tokens: int
) -> None:
    messages = [{"role": "user", "content": content}]
    _, streamed = await stream_final(client, model=model, max_tokens=max_tokens, messages=messages)
    whole = await client.messages.create(model=model, max_tokens=max_tokens, messages=messages)
    assert blocks(whole) == blocks(streamed)
    assert whole.stop_reason == streamed.stop_reason
    assert whole.stop_sequence == streamed.stop_sequence
    assert whole.usage.output_tokens == streamed.usage.output_tokens
    # The same prompt, whatever part of it the upstream's cache held the second time.
    assert prompt_of(whole.usage) == prompt_of(streamed.usage) > 0
    assert whole.model == streamed.model == model
    assert whole.id.startswith("msg_") and whole.id != streamed.id


async def test_sdk_create_non_streaming_tool_call_matches_the_stream(
    client: AsyncAnthropic,
) -> None:
    # The stub's non-streaming tool answer always names its tool "lookup", so the stream is
    # asked with a tool of that name too.
    params: dict[str, Any] = dict(
        model="tool", max_tokens=64, tools=[WEATHER_TOOL],
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    _, streamed = await stream_final(client, **params)
    whole = await client.messages.create(**params)
    assert blocks(whole) == blocks(streamed)
    assert whole.content[0].input == {"query": "weather in Paris"}
    assert whole.stop_reason == streamed.stop_reason == "tool_use"
    assert whole.usage.output_tokens == streamed.usage.output_tokens


async def test_sdk_message_start_carries_input_tokens_from_the_upstreams_template_and_tokenizer(
    client: AsyncAnthropic,
) -> None:
    prompt = "hello there general kenobi how are you"
    events, _ = await stream_final(
        client, model="chat", max_tokens=64, messages=[{"role": "user", "content": prompt}]
    )
    start = events[0]
    assert start.type == "message_start"
    # The stub's /apply-template then /tokenize: its preamble counted, as its own usage counts it.
    expected = prompt_tokens({"messages": [{"role": "user", "content": prompt}]})
    assert start.message.usage.input_tokens == expected
    assert len(prompt) // 4 != expected


async def test_sdk_message_start_echoes_the_client_model_name_through_an_alias(
    client: AsyncAnthropic,
) -> None:
    events, final = await stream_final(
        client, model="claude-sonnet-4", max_tokens=64, messages=HI
    )
    assert events[0].message.model == "claude-sonnet-4"
    assert final.model == "claude-sonnet-4"
    assert final.content[0].thinking == REASONING_TEXT  # the alias reached the reasoning model


async def test_sdk_count_tokens_returns_the_upstreams_templated_count(
    client: AsyncAnthropic,
) -> None:
    prompt = "count these five words"
    counted = await client.messages.count_tokens(
        model="chat", messages=[{"role": "user", "content": prompt}]
    )
    asked = [{"role": "user", "content": prompt}]
    assert counted.input_tokens == prompt_tokens({"messages": asked})
    raw = await client.messages.with_raw_response.count_tokens(
        model="chat", messages=[{"role": "user", "content": prompt}]
    )
    assert raw.http_request.url.path == "/llm/v1/messages/count_tokens"
    assert raw.headers["X-Hal0d-Token-Count"] == "template"


async def test_sdk_unknown_model_raises_not_found(client: AsyncAnthropic) -> None:
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as raised:
        await client.messages.create(model="gpt-9", max_tokens=64, messages=HI)
    assert raised.value.status_code == 404
    assert raised.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    assert "gpt-9" in raised.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        async with client.messages.stream(model="gpt-9", max_tokens=64, messages=HI) as stream:
            async for _ in stream:
                pass


async def test_sdk_missing_max_tokens_raises_bad_request_naming_the_field(
    client: AsyncAnthropic,
) -> None:
    import anthropic

    try:
        import httpx2 as httpx
    except ModuleNotFoundError:  # the SDK built on httpx before it moved to httpx2
        import httpx  # type: ignore[no-redef,import-not-found,unused-ignore]

    with pytest.raises(anthropic.BadRequestError) as raised:
        await client.post(
            "/v1/messages",
            body={"model": "chat", "messages": HI},
            cast_to=httpx.Response,
        )
    assert raised.value.status_code == 400
    error = raised.value.body["error"]  # type: ignore[index]
    assert error["type"] == "invalid_request_error"
    assert "max_tokens" in error["message"]


async def test_sdk_api_key_is_sent_as_x_api_key_and_checked_by_hal0d(
    stub: Stub, start_hal0d: Any, tmp_path: Any
) -> None:
    import anthropic

    config = make_config(stub.url, tmp_path=tmp_path)
    config = dataclasses.replace(
        config, server=ServerConfig(api_keys=("sk-local",), accepted_keys=frozenset({"sk-local"}))
    )
    hal0d = await start_hal0d(stub.url, config=config)
    base_url = str(hal0d.make_url("/llm"))
    async with anthropic.AsyncAnthropic(
        base_url=base_url, api_key="sk-local", max_retries=0
    ) as sdk:
        _, final = await stream_final(sdk, model="chat", max_tokens=64, messages=HI)
        assert final.content[0].text == CONTENT_TEXT
    async with anthropic.AsyncAnthropic(
        base_url=base_url, api_key="sk-wrong", max_retries=0
    ) as sdk:
        with pytest.raises(anthropic.AuthenticationError) as raised:
            await stream_final(sdk, model="chat", max_tokens=64, messages=HI)
    assert raised.value.status_code == 401
    assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
