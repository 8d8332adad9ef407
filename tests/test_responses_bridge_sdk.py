"""The Responses API for a slot that speaks only chat completions (`responses = "translate"`),
driven by the official openai SDK over real sockets.

The stub is made `chat_only` (no /v1/responses, as llama-cpp-python's server): every answer the
SDK gets was translated by hal0d from a chat completion. What the SDK ends up with is compared to
what the stub generated (hal0d_stub.models' texts), and the stall and break cases to the endings
the native path gives (README "The Responses API").
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d_stub.answering import TOKENS_BEFORE_TROUBLE
from hal0d_stub.app import make_stub_app
from hal0d_stub.models import CONTENT_TEXT, REASONING_TEXT, SHELL_ANSWER, SHELL_COMMAND, words
from tests.harness.client import openai_sdk
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

if TYPE_CHECKING:
    from openai import AsyncOpenAI

STALL_BOUNDS = {"stream_idle_timeout_s": 0.5, "stream_total_timeout_s": 30.0}
EXEC_TOOL = {"type": "function", "name": "exec_command", "description": "Runs a command.",
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}},
                            "required": ["cmd"]}}


@pytest.fixture
async def chat_stub(aiohttp_server: Any, tmp_path: Path) -> Stub:
    log = tmp_path / f"stub-{free_port()}.log"
    server = await aiohttp_server(make_stub_app(log, 0.002, chat_only=True))
    return Stub(server, log)


@pytest.fixture
async def hal0d(chat_stub: Stub, start_hal0d: Any) -> TestServer:
    return await start_hal0d(chat_stub.url, slot={"responses": "translate"},
                             aliases={"gpt-*": "chat"})


@pytest.fixture
async def client(hal0d: TestServer) -> AsyncIterator[AsyncOpenAI]:
    async with openai_sdk(hal0d) as client:
        yield client


async def test_a_streamed_text_answer_is_translated_from_the_chat_stream(
    client: AsyncOpenAI, chat_stub: Stub
) -> None:
    async with client.responses.stream(model="gpt-4o", input="hi",
                                       instructions="Be brief.") as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.output_text == CONTENT_TEXT
    assert final.status == "completed" and final.model == "gpt-4o"
    assert final.usage is not None and final.usage.output_tokens == len(words(CONTENT_TEXT))
    assert final.usage.input_tokens > 0
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == len(words(CONTENT_TEXT))
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert any("endpoint=chat" in line for line in chat_stub.lines())
    assert not any("endpoint=responses" in line for line in chat_stub.lines())


async def test_a_whole_answer_is_one_response_object(client: AsyncOpenAI) -> None:
    answer = await client.responses.create(model="reasoning", input="hi", max_output_tokens=200,
                                           reasoning={"effort": "low"})
    assert answer.object == "response" and answer.status == "completed"
    assert answer.output_text == CONTENT_TEXT
    assert [item.type for item in answer.output] == ["reasoning", "message"]
    assert answer.output[0].content[0].text == REASONING_TEXT  # type: ignore[union-attr,index]
    assert answer.usage is not None and answer.usage.output_tokens > 0


async def test_reasoning_streams_as_a_reasoning_item_before_the_message(
    client: AsyncOpenAI,
) -> None:
    async with client.responses.stream(model="reasoning", input="hi") as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message"]
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == REASONING_TEXT and final.output_text == CONTENT_TEXT
    indices = {e.output_index for e in events if e.type == "response.output_item.added"}
    assert indices == {0, 1}
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(events)))


async def test_a_function_call_round_trip(client: AsyncOpenAI, chat_stub: Stub) -> None:
    """function_call out; the client runs it and sends function_call_output back with the
    call; the model's answer reads the result."""
    async with client.responses.stream(model="shell", input="run it",
                                       tools=[EXEC_TOOL]) as stream:
        deltas = [e.delta async for e in stream
                  if e.type == "response.function_call_arguments.delta"]
        first = await stream.get_final_response()
    (call,) = first.output
    assert call.type == "function_call" and call.name == "exec_command"
    assert json.loads(call.arguments) == {"cmd": SHELL_COMMAND}
    assert "".join(deltas) == call.arguments
    result = "hal0d-42\n"
    follow_up = [
        {"role": "user", "content": "run it"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": result},
    ]
    answer = await client.responses.create(model="shell", input=follow_up,  # type: ignore[arg-type]
                                           tools=[EXEC_TOOL])  # type: ignore[list-item]
    assert answer.output_text == SHELL_ANSWER + result.strip()


async def test_the_tool_model_streams_its_call_and_ends_completed(client: AsyncOpenAI) -> None:
    async with client.responses.stream(model="tool", input="weather?", tools=[EXEC_TOOL]) as s:
        async for _ in s:
            pass
        final = await s.get_final_response()
    assert final.status == "completed"
    assert [(item.type, item.name) for item in final.output] == [  # type: ignore[union-attr]
        ("function_call", "exec_command")]
    assert json.loads(final.output[0].arguments) == {  # type: ignore[union-attr]
        "query": "weather in Paris"}


async def test_a_stall_ends_incomplete_with_the_notice(chat_stub: Stub, start_hal0d: Any) -> None:
    hal0d = await start_hal0d(chat_stub.url, slot={"responses": "translate"},
                              dispatcher=STALL_BOUNDS)
    async with openai_sdk(hal0d) as client, client.responses.stream(model="stall",
                                                                    input="hi") as stream:
        events = [event async for event in stream]
    last = events[-1]
    assert last.type == "response.incomplete"
    assert last.response.incomplete_details is not None
    assert last.response.incomplete_details.reason == "max_output_tokens"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text.startswith("".join(words(CONTENT_TEXT)[:TOKENS_BEFORE_TROUBLE]))
    assert "stall guard" in text and "stream_idle_timeout_s" in text
    assert (last.response.model_extra or {})["x_hal0_stall"]["reason"] == "idle"


async def test_a_break_raises_in_the_sdk(client: AsyncOpenAI) -> None:
    from openai import APIError

    seen: list[str] = []
    with pytest.raises(APIError, match="broke the stream"):
        async with client.responses.stream(model="broken", input="hi") as stream:
            async for event in stream:
                seen.append(event.type)
    assert seen.count("response.output_text.delta") == TOKENS_BEFORE_TROUBLE


@pytest.mark.parametrize(("field", "value"), [
    ("previous_response_id", "resp_abc"), ("store", True), ("background", True)])
async def test_what_needs_a_stored_answer_is_a_400_naming_it(
    client: AsyncOpenAI, chat_stub: Stub, field: str, value: Any
) -> None:
    from openai import BadRequestError

    with pytest.raises(BadRequestError) as raised:
        await client.responses.create(model="chat", input="hi", **{field: value})
    body = raised.value.body
    assert isinstance(body, dict)
    assert body["code"] == "request.invalid" and body["param"] == field
    assert "chat completions" in body["message"] and 'responses = "translate"' in body["message"]
    assert not any("endpoint=chat" in line for line in chat_stub.lines())


async def test_store_false_as_codex_sends_it_is_taken(client: AsyncOpenAI) -> None:
    answer = await client.responses.create(model="chat", input="hi", store=False)
    assert answer.output_text == CONTENT_TEXT


async def test_auto_translates_for_an_upstream_without_the_endpoint_and_asks_once(
    chat_stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(chat_stub.url, slot={"responses": "auto"})
    with capture_logs() as logs:
        async with openai_sdk(hal0d) as client:
            for _ in range(2):
                answer = await client.responses.create(model="chat", input="hi")
                assert answer.output_text == CONTENT_TEXT
    chosen = [e for e in logs if e["event"] == "responses.mode_chosen"]
    assert [(e["mode"], e["probe_status"]) for e in chosen] == [("translate", 404)]


async def test_auto_relays_natively_to_an_upstream_with_the_endpoint(
    stub: Stub, start_hal0d: Any
) -> None:
    hal0d = await start_hal0d(stub.url, slot={"responses": "auto"})
    with capture_logs() as logs:
        async with openai_sdk(hal0d) as client:
            answer = await client.responses.create(model="chat", input="hi")
    assert answer.output_text == CONTENT_TEXT and answer.id.startswith("resp_")
    assert [(e["mode"], e["probe_status"]) for e in logs
            if e["event"] == "responses.mode_chosen"] == [("native", 400)]
    await eventually(lambda: any("endpoint=responses status=200" in line
                                 for line in stub.lines()), 5, "the native answer")
