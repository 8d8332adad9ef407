"""The stub's context, over real sockets: a prompt past a server slot's n_ctx (ctx_size //
parallel) is refused with the very bytes the real llama-server sent (tests/fixtures/llama-server/
exceed-context*), streamed or not, on every completion endpoint; a prompt that fits is answered
until the context is full, as llama-server answers it; GET /props tells the n_ctx the stub holds;
and, made with max_model_len, the stub refuses as vLLM does and lists the figure."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import orjson
import pytest

from hal0d_stub.prompt import prompt_tokens
from hal0d_stub.slots import SlotOptions
from tests.fixtures_util import fixture_path
from tests.harness.cli import ROOT
from tests.harness.daemons import stop
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import StubFactory

PROPS_FILE = fixture_path("llama-server/props.json")
CAPTURED = fixture_path("llama-server/exceed-context.json").read_bytes()
CAPTURED_PROMPT, CAPTURED_CTX = 630, 256  # the capture's figures


def chat_of(tokens: int, **extra: Any) -> dict[str, Any]:
    """A chat request whose prompt is `tokens` tokens as the stub counts it (its template and
    BOS included); a system prompt of its own, so the template adds none."""
    def body(words: int) -> dict[str, Any]:
        content = " ".join(["word"] * words)
        return {"model": "chat", "messages": [{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": content}], **extra}

    words = tokens - prompt_tokens(body(1)) + 1
    assert words >= 1 and prompt_tokens(body(words)) == tokens
    return body(words)


def completion_of(tokens: int, **extra: Any) -> dict[str, Any]:
    """A legacy completion whose prompt is `tokens` tokens (its words and BOS)."""
    return {"model": "chat", "prompt": " ".join(["word"] * (tokens - 1)), **extra}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any]
               ) -> tuple[int, str, bytes]:
    async with http.post(url, json=body) as resp:
        return resp.status, resp.headers["Content-Type"], await resp.read()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_prompt_past_the_slot_is_refused_in_llama_servers_very_bytes(
        start_stub: StubFactory, http: aiohttp.ClientSession, stream: bool) -> None:
    """Two slots of a 512-token context hold 256 each: the capture's 630-token prompt gets the
    capture's status, content type and body, byte for byte, streamed or not."""
    stub = await start_stub(slot_options=SlotOptions(ctx_size=2 * CAPTURED_CTX, parallel=2))
    url = f"{stub.url}/v1/chat/completions"
    got = await post(http, url, chat_of(CAPTURED_PROMPT, max_tokens=16, stream=stream))
    assert got == (400, "application/json; charset=utf-8", CAPTURED)
    legacy = await post(http, f"{stub.url}/v1/completions",
                        completion_of(CAPTURED_PROMPT, stream=stream))
    assert legacy == got
    assert not [line for line in stub.lines() if "slot-select" in line]  # no slot took it


async def test_a_prompt_of_exactly_n_ctx_is_refused_and_one_less_fills_the_context(
        start_stub: StubFactory, http: aiohttp.ClientSession) -> None:
    """llama-server refuses at n_tokens >= n_ctx; a prompt that fits is answered until prompt
    and answer fill the context, max_tokens or not (finish_reason "length")."""
    stub = await start_stub(slot_options=SlotOptions(ctx_size=64, parallel=2))
    url = f"{stub.url}/v1/completions"
    status, _, body = await post(http, url, completion_of(32, max_tokens=10))
    assert status == 400
    assert orjson.loads(body)["error"] | {"message": None} == {
        "code": 400, "message": None, "type": "exceed_context_size_error",
        "n_prompt_tokens": 32, "n_ctx": 32}
    status, _, body = await post(http, url, completion_of(29, max_tokens=10))
    answer = orjson.loads(body)
    assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"] | {"prompt_tokens_details": None} == {
        "prompt_tokens": 29, "completion_tokens": 3, "total_tokens": 32,
        "prompt_tokens_details": None}
    async with http.post(f"{stub.url}/v1/chat/completions",
                         json=chat_of(30, stream=True, max_tokens=10)) as resp:
        frames = [orjson.loads(line[6:]) for line in (await resp.read()).split(b"\n\n")
                  if line.startswith(b"data: {")]
    pieces = [f for f in frames if f["choices"] and f["choices"][0]["delta"].get("content")]
    assert len(pieces) == 2 and frames[-1]["choices"][0]["finish_reason"] == "length"


async def test_the_responses_and_messages_endpoints_refuse_it_as_well(
        start_stub: StubFactory, http: aiohttp.ClientSession) -> None:
    stub = await start_stub(slot_options=SlotOptions(ctx_size=32), anthropic_native=True)
    long = " ".join(["word"] * 40)
    for path, body in (("/v1/responses", {"model": "chat", "input": long}),
                       ("/v1/messages", {"model": "chat", "max_tokens": 8,
                                         "messages": [{"role": "user", "content": long}]})):
        status, _, answer = await post(http, stub.url + path, body)
        error = orjson.loads(answer)["error"]
        assert (status, error["type"], error["n_ctx"]) == (400, "exceed_context_size_error", 32)
        assert error["n_prompt_tokens"] > 40


async def test_as_vllm_the_prompt_and_max_tokens_must_fit_max_model_len(
        start_stub: StubFactory, http: aiohttp.ClientSession) -> None:
    stub = await start_stub(max_model_len=100, anthropic_native=True)
    url = f"{stub.url}/v1/chat/completions"
    status, _, body = await post(http, url, chat_of(60, max_tokens=50))
    assert status == 400
    assert orjson.loads(body) == {
        "object": "error", "type": "BadRequestError", "param": None, "code": 400,
        "message": "This model's maximum context length is 100 tokens. However, you requested "
                   "110 tokens (60 in the messages, 50 in the completion). Please reduce the "
                   "length of the messages or completion."}
    status, _, body = await post(http, url, chat_of(100))  # no max_tokens: the prompt alone
    assert status == 400 and orjson.loads(body)["message"] == (
        "This model's maximum context length is 100 tokens. However, you requested 100 tokens "
        "in the messages, Please reduce the length of the messages.")
    assert (await post(http, url, chat_of(60, max_tokens=40)))[0] == 200
    status, _, body = await post(http, f"{stub.url}/v1/messages", {
        "model": "chat", "max_tokens": 50, "messages": chat_of(60)["messages"]})
    assert status == 400 and orjson.loads(body)["error"]["type"] == "BadRequestError"
    async with http.get(f"{stub.url}/v1/models") as resp:
        listed = (await resp.json())["data"]
    assert {entry["max_model_len"] for entry in listed} == {100}


async def test_props_tells_the_context_the_slots_hold(
        start_stub: StubFactory, http: aiohttp.ClientSession) -> None:
    """The capture says 2048: a stub given it and no slot options holds 2048 (the tests that
    read /api/ps rely on that figure); given slot options, their n_ctx is what /props says."""
    props = json.loads(PROPS_FILE.read_text())
    described = await start_stub(props=props)
    sized = await start_stub(props=props, slot_options=SlotOptions(ctx_size=1024, parallel=4))
    for stub, n_ctx in ((described, 2048), (sized, 256)):
        async with http.get(f"{stub.url}/props") as resp:
            told = await resp.json()
        assert told["default_generation_settings"]["n_ctx"] == n_ctx
        assert told["chat_template"] == props["chat_template"]
        status, _, body = await post(http, f"{stub.url}/v1/completions", completion_of(n_ctx))
        assert status == 400 and orjson.loads(body)["error"]["n_ctx"] == n_ctx
    async with http.get(f"{(await start_stub()).url}/props") as resp:
        assert resp.status == 404  # without props, as vLLM


@asynccontextmanager
async def stub_process(*flags: str) -> AsyncIterator[str]:
    """`hal0d stub` with these flags as its own process, its URL once it answers."""
    port = free_port()
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--delay", "0", *flags,
        cwd=ROOT, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    async def answers() -> bool:
        assert process.returncode is None, f"the stub exited with {process.returncode}"
        try:
            async with aiohttp.ClientSession() as session, session.get(f"{url}/slots") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    try:
        await eventually(answers, 15.0, "the stub answers")
        yield url
    finally:
        await stop(process)


async def test_the_command_line_takes_the_context_from_props_unless_c_is_given(
        http: aiohttp.ClientSession) -> None:
    for flags, n_ctx in ((("--props", str(PROPS_FILE)), 2048),
                         (("--props", str(PROPS_FILE), "-c", "64", "-np", "2"), 32)):
        async with stub_process(*flags) as url:
            async with http.get(f"{url}/props") as resp:
                assert (await resp.json())["default_generation_settings"]["n_ctx"] == n_ctx
            async with http.get(f"{url}/slots") as resp:
                assert {slot["n_ctx"] for slot in await resp.json()} == {n_ctx}
            status, _, body = await post(http, f"{url}/v1/completions", completion_of(n_ctx))
            assert status == 400 and orjson.loads(body)["error"]["n_ctx"] == n_ctx
