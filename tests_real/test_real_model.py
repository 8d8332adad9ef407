"""End to end on a real model server: llama.cpp's llama-server running SmolLM2-135M as a slot
`command` of a real `hal0d serve`, driven with the openai, anthropic and ollama clients.

Run by `make test-real`, which builds llama-server from the llama.cpp sources llama-cpp-python's
sdist vendors and extracts the model; it passes their paths in HAL0D_REAL_SERVER and
HAL0D_REAL_MODEL. Not part of `make test`: the build takes minutes.

The one llama-server is reached through several slots, each a way a user runs it: `real` (hal0d
starts it; Anthropic translated, Responses relayed natively), `real-bridge` (the same upstream,
`responses = "translate"`), `real-native` (`anthropic = "native"`: llama-server's own
/v1/messages), and the route `either` whose first slot is a dead port. What llama-server does that
the stub does not: its own chat template and tokenizer (POST /apply-template and /tokenize, so a
count is exact), seconds to load the model (the slot is `starting` meanwhile and requests queue),
and a /v1/responses stream without output_index, content_index or sequence_number, which the
native relay completes (test_real_responses.py) and the bridge translates from chat completions
(where a cut answer is `response.incomplete`, as the API says it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import aiohttp
import anthropic
import openai
import pytest
from realserver import (
    free_port,
    get_json,
    require_real_server,
    running_hal0d,
    server_command,
    slots,
)

MODEL = "smollm2"
BRIDGED = "smollm2-bridged"  # the same server, its Responses API translated to chat completions
NATIVE = "smollm2-native"  # the same server, its own Anthropic Messages API
ROUTED = "either"  # a route: a dead port first, then the real slot


def slot_state(base: str) -> dict:
    return slots(base)["real"]


OLLAMA_PORT = free_port()


@pytest.fixture(scope="module")
def hal0d(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    require_real_server()
    upstream_port = free_port()
    upstream = f"http://127.0.0.1:{upstream_port}"
    config = {
        "ollama": {"listen": f"127.0.0.1:{OLLAMA_PORT}"},
        "slots": [
            {"name": "real", "upstream": upstream, "models": [MODEL], "max_concurrent": 1,
             "command": server_command(MODEL, upstream_port)},
            {"name": "real-bridge", "upstream": upstream, "models": [BRIDGED],
             "responses": "translate", "capabilities": ["tools"]},
            {"name": "real-native", "upstream": upstream, "models": [NATIVE],
             "anthropic": "native"},
            {"name": "dead", "upstream": f"http://127.0.0.1:{free_port()}",
             "models": ["dead-only"]},
        ],
        "routes": [{"model": ROUTED, "slots": ["dead", "real"], "served": {"real": MODEL}}],
    }
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
    assert answer.model == MODEL  # the server's --alias, relayed as it came


def test_openai_sdk_stream_is_relayed_to_the_end(hal0d: str) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused")
    stream = client.chat.completions.create(
        model=MODEL, max_tokens=24, stream=True,
        messages=[{"role": "user", "content": "Say hello."}],
    )
    text, finish = "", None
    for chunk in stream:
        assert chunk.model == MODEL
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


def test_count_tokens_is_exact_the_servers_own_prompt_count_through_its_template(
    hal0d: str,
) -> None:
    messages = [{"role": "user", "content": "one two three four five six"}]
    counted = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused").messages \
        .with_raw_response.count_tokens(model=MODEL, messages=messages)
    assert counted.headers["X-Hal0d-Token-Count"] == "template"
    server = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused").chat.completions.create(
        model=MODEL, max_tokens=4, messages=messages)
    assert server.usage is not None
    assert counted.parse().input_tokens == server.usage.prompt_tokens


def test_the_responses_stream_is_read_through_the_bridge(
    hal0d: str,
) -> None:
    client = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused", max_retries=0)
    with client.responses.stream(model=BRIDGED, input="Say hello.",
                                 max_output_tokens=24) as stream:
        events = list(stream)  # the SDK checks every event's indices as it reads them
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text.strip()
    # A short budget often ends in `length`: response.incomplete, as the API says it.
    last = events[-1]
    assert last.type in ("response.completed", "response.incomplete"), last.type
    assert last.response.usage is not None and last.response.usage.output_tokens > 0
    assert [event.sequence_number for event in events] == list(range(len(events)))
    whole = client.responses.create(model=BRIDGED, input="Say hello.", max_output_tokens=24)
    assert whole.output_text.strip()
    # The native relay answers a whole request as llama-server does.
    native = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=24)
    assert native.output_text.strip()


def test_anthropic_native_relays_llama_servers_own_messages_stream(hal0d: str) -> None:
    client = anthropic.Anthropic(base_url=f"{hal0d}/llm", api_key="unused", max_retries=0)
    with client.messages.stream(model=NATIVE, max_tokens=24, messages=[
            {"role": "user", "content": "Say hello."}]) as stream:
        message = stream.get_final_message()
    assert message.content[-1].type == "text" and message.content[-1].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_an_ollama_client_chats_with_the_real_model(hal0d: str) -> None:
    import ollama

    client = ollama.Client(host=f"http://127.0.0.1:{OLLAMA_PORT}")
    assert MODEL in [model.model for model in client.list().models]
    text = "".join(part.message.content or "" for part in client.chat(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], stream=True,
        options={"num_predict": 24}))
    assert text.strip()
    whole = client.chat(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                        options={"num_predict": 24})
    assert whole.done_reason in ("stop", "length") and (whole.eval_count or 0) > 0


def test_ollamas_show_says_what_llama_servers_props_say_unless_the_config_declares(
        hal0d: str) -> None:
    """SmolLM2's chat template takes no tools and does not reason: llama-server's /props says
    so, and /api/show does too; the slot that declares `tools` says that; /api/ps shows the
    context llama-server holds."""
    import ollama

    upstream = slots(hal0d)["real"]["upstream"]
    props = get_json(f"{upstream}/props")
    assert not props["chat_template_caps"]["supports_tool_calls"]
    assert not props["modalities"]["vision"]
    client = ollama.Client(host=f"http://127.0.0.1:{OLLAMA_PORT}")
    assert client.show(MODEL).capabilities == ["completion"]
    assert client.show(ROUTED).capabilities == ["completion"]  # its loaded slot's model
    assert client.show(BRIDGED).capabilities == ["completion", "tools"]
    running = get_json(f"http://127.0.0.1:{OLLAMA_PORT}/api/ps")["models"]
    context = {model["name"]: model["context_length"] for model in running}
    assert context[MODEL] == props["default_generation_settings"]["n_ctx"] == 2048


def test_a_route_whose_first_slot_is_dead_is_answered_by_the_real_one(hal0d: str) -> None:
    answer = openai.OpenAI(base_url=f"{hal0d}/v1", api_key="unused").chat.completions.create(
        model=ROUTED, max_tokens=16, messages=[{"role": "user", "content": "Say hello."}])
    assert answer.choices[0].message.content
    [row] = get_json(f"{hal0d}/api/requests?limit=1")["requests"]
    # Its probe found the dead slot down: tried after the one that answers, so nothing waits.
    assert (row["slot"], row["attempts"], row["failover"]) == ("real", 1, None)


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
