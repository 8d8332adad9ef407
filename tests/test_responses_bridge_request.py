"""The Responses bridge's request side: a Responses request in, the chat completion out (the tools
a chat backend can run mapped and the rest dropped, a Codex conversation as chat messages, what a
chat upstream cannot take refused naming its field, images, the slot's bound on the output); a
whole chat completion back as a Response object; and the slot's `auto` mode, which asks again
after an answer that decides nothing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from structlog.testing import capture_logs

from hal0d.errors import InvalidRequest
from hal0d.openai.responses_answer import to_response
from hal0d.openai.responses_request import chat_request
from hal0d_stub.app import make_stub_app
from hal0d_stub.models import CONTENT_TEXT
from tests.fixtures_util import fixture_path
from tests.harness.daemons import ServerFactory
from tests.harness.logs import logs_into_buffer
from tests.harness.ports import free_port
from tests.harness.responses_bridge import CUSTOM_TOOLS, request
from tests.harness.stubs import Stub, answering_first

# -- a Responses request in, a chat completion request out -----------------------------------------


def test_the_tools_a_chat_backend_cannot_run_are_dropped_and_the_rest_mapped() -> None:
    req = request(tools=CUSTOM_TOOLS, tool_choice={"type": "custom", "name": "apply_patch"})
    names = [tool["function"]["name"] for tool in req.body["tools"]]
    assert names == ["apply_patch", "local_shell", "agents__spawn"]
    assert req.tools.dropped == ["web_search"]
    assert req.body["tool_choice"] == {"type": "function", "function": {"name": "apply_patch"}}
    patch = req.body["tools"][0]["function"]
    assert patch["parameters"]["required"] == ["input"] and "start: /.+/" in patch["description"]


def test_a_codex_conversation_becomes_chat_messages() -> None:
    req = request(instructions="Be brief.", tools=CUSTOM_TOOLS, max_output_tokens=64,
                  reasoning={"effort": "low", "summary": "auto"}, store=False,
                  input=[
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "You are Codex."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": None},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Running it."}]},
        {"type": "function_call", "call_id": "c1", "name": "exec_command",
         "arguments": '{"cmd": "ls"}'},
        {"type": "function_call", "call_id": "c2", "name": "spawn", "namespace": "agents",
         "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "a.txt"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "spawned"}]},
        {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch", "input": "P"},
        {"type": "custom_tool_call_output", "call_id": "c3", "output": "patched"},
        {"type": "local_shell_call", "call_id": "c4", "status": "completed",
         "action": {"type": "exec", "command": ["pwd"]}},
        {"type": "local_shell_call_output", "call_id": "c4", "output": "/w"},
    ])
    body = req.body
    assert body["max_tokens"] == 64 and body["reasoning_effort"] == "low"
    assert body["stream_options"] == {"include_usage": True} and body["model"] == "served"
    messages = body["messages"]
    assert messages[0] == {"role": "system", "content": "Be brief.\n\nYou are Codex."}
    assert messages[1] == {"role": "user", "content": "ls"}
    assistant = messages[2]
    assert assistant["content"] == "Running it."
    assert [(c["id"], c["function"]["name"]) for c in assistant["tool_calls"]] == [
        ("c1", "exec_command"), ("c2", "agents__spawn")]
    assert messages[3:5] == [{"role": "tool", "tool_call_id": "c1", "content": "a.txt"},
                             {"role": "tool", "tool_call_id": "c2", "content": "spawned"}]
    assert messages[5]["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                        "arguments": '{"input":"P"}'}
    assert messages[6] == {"role": "tool", "tool_call_id": "c3", "content": "patched"}
    assert orjson.loads(messages[7]["tool_calls"][0]["function"]["arguments"]) == {
        "command": ["pwd"]}
    assert messages[8]["content"] == "/w" and len(messages) == 9


@pytest.mark.parametrize(("payload", "field"), [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "message", "role": "tool", "content": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input"),
    ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input"),
    ({"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]},
                {"role": "user", "content": "and?"}]}, "input"),
    ({"tools": [{"type": "function"}]}, "tools"),
])
def test_what_a_chat_upstream_cannot_take_is_refused(payload: dict[str, Any],
                                                      field: str) -> None:
    with pytest.raises(InvalidRequest) as raised:
        request(**payload)
    assert raised.value.field == field


IMAGE = {"type": "input_image", "image_url": "data:image/png;base64,iVBORw0KGgo="}


def test_a_users_image_goes_on_as_an_image_url_part_beside_its_text() -> None:
    (message,) = request(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "What is it?"}, IMAGE]}]).body["messages"]
    assert message == {"role": "user", "content": [
        {"type": "text", "text": "What is it?"},
        {"type": "image_url", "image_url": {"url": IMAGE["image_url"]}}]}


@pytest.mark.parametrize("role", ["system", "developer"])
async def test_an_image_in_a_system_or_developer_message_is_a_400_naming_the_part(
    role: str, aiohttp_server: Any, start_hal0d: ServerFactory, tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    """Chat completions take images from a user only: the message is refused in OpenAI's
    envelope before the slot is taken, not failed on the way (a 500 with a traceback)."""
    log = tmp_path / f"stub-{free_port()}.log"
    chat_stub = Stub(await aiohttp_server(make_stub_app(log, 0.002, chat_only=True)), log)
    hal0d = await start_hal0d(chat_stub.url, slot={"responses": "translate"})
    payload = {"model": "chat", "input": [
        {"type": "message", "role": role,
         "content": [{"type": "input_text", "text": "Describe it."}, IMAGE]},
        {"type": "message", "role": "user", "content": "hi"},
    ]}
    with logs_into_buffer("json", "info") as buffer:
        async with http.post(hal0d.make_url("/v1/responses"), json=payload) as resp:
            status, body = resp.status, await resp.json()
    assert status == 400, body
    error = body["error"]
    assert (error["type"], error["code"], error["param"]) == (
        "invalid_request_error", "request.invalid", "input")
    assert error["message"].startswith(
        f"input[0].content[1] is an input_image part in a {role} message: a {role} message "
        "holds text only"), error
    lines = [orjson.loads(line) for line in buffer.getvalue().splitlines()]
    assert not [line for line in lines if line["event"] == "request.failed"], lines
    assert not any("endpoint=chat" in line for line in chat_stub.lines())


def test_the_slot_bound_caps_max_output_tokens() -> None:
    capped = chat_request({"input": "hi", "max_output_tokens": 900}, served_model="s",
                          max_output_tokens=100)
    assert capped.body["max_tokens"] == 100 and capped.body["stream"] is False
    assert chat_request({"input": "hi"}, served_model="s", max_output_tokens=50).body[
        "max_tokens"] == 50


# -- a whole chat completion back as a Response object ---------------------------------------------


def test_a_whole_completion_becomes_a_response_object() -> None:
    req = request(tools=[{"type": "local_shell"}])
    completion = {"choices": [{"finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "ok", "reasoning_content": "think",
        "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "local_shell", "arguments": '{"command": ["id"]}'}}]}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 2}}
    answer = to_response(completion, req, model="m")
    assert [item["type"] for item in answer["output"]] == ["reasoning", "message",
                                                           "local_shell_call"]
    assert answer["status"] == "completed" and answer["usage"]["total_tokens"] == 7
    with pytest.raises(ValueError):
        to_response({"choices": []}, req, model="m")


def test_a_whole_answers_cached_part_is_input_tokens_details_cached_tokens() -> None:
    warm = orjson.loads(fixture_path("llama-server/chat-warm.json").read_bytes())
    usage = to_response(warm, request(stream=False), model="m")["usage"]
    assert (usage["input_tokens"], usage["input_tokens_details"]) == (917, {"cached_tokens": 903})


# -- the slot's `auto` mode: translated or native, asked of the upstream ---------------------------


@pytest.mark.parametrize("chat_only", [True, False])
async def test_auto_asks_again_after_an_answer_that_decides_nothing(
    chat_only: bool, aiohttp_server: Any, start_hal0d: ServerFactory, tmp_path: Path
) -> None:
    """A 503 from a server still loading its model says nothing of its /v1/responses: that
    request is translated, and the next one asks again."""
    log = tmp_path / "stub.log"
    app = answering_first(503, make_stub_app(log, 0.002, chat_only=chat_only), "/v1/responses")
    stub = Stub(await aiohttp_server(app), log)
    hal0d = await start_hal0d(stub.url, slot={"responses": "auto"})
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(hal0d.make_url("/v1/responses"),
                                     json={"model": "chat", "input": "hi"}) as resp:
                    assert resp.status == 200, await resp.text()
                    answer = await resp.json()
                message = next(item for item in answer["output"] if item["type"] == "message")
                assert message["content"][0]["text"] == CONTENT_TEXT
    assert [e["probe_status"] for e in logs if e["event"] == "responses.mode_undecided"] == [503]
    chosen = [(e["mode"], e["probe_status"]) for e in logs
              if e["event"] == "responses.mode_chosen"]
    assert chosen == [("translate", 404) if chat_only else ("native", 400)]
    native = [line for line in stub.lines() if "endpoint=responses status=200" in line]
    translated = [line for line in stub.lines() if "endpoint=chat status=200" in line]
    assert (len(native), len(translated)) == ((0, 3) if chat_only else (2, 1))
