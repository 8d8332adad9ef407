"""An upstream's own context error reaches every client in its own API's words.

When a prompt reaches an upstream that cannot hold it (hal0d's estimate was too low, or the
server counts differently), the server's 400 (llama-server's exceed_context_size_error, vLLM's
"maximum context length is N tokens") becomes hal0d's ContextExceeded: the openai SDK raises
BadRequestError with code context_length_exceeded, the anthropic SDK BadRequestError with
"prompt is too long: ...", the Ollama API answers 400 {"error": ...}, streamed or not, and the
history records context_exceeded. First the recogniser alone, fed the real llama-server's
captures; then hal0d over real sockets in front of the stub with a small context (its refusals
are the capture's bytes: tests/test_stub_context.py), and a real `hal0d serve` whose slots run
the stub with -c/-np and --max-model-len. A 400 that is no context error passes as it did.

The SDKs are imported where they are used: importing them costs about a second at collection.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from hal0d.errors import ContextExceeded
from hal0d.protocol.context_errors import context_exceeded
from hal0d_stub.prompt import prompt_tokens
from hal0d_stub.slots import SlotOptions
from tests.fixtures_util import fixture_path
from tests.harness.client import Served
from tests.harness.config import build_config, config_text, on_demand
from tests.harness.daemons import ServerFactory, serving, start
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, StubFactory, Upstream, stub_command

N_CTX = 32  # each of the stub's two server slots: -c 64 -np 2
MAX_MODEL_LEN = 120  # the vLLM-like stub's: the prompt of USER and less than 21 more
LONG = " ".join(["The quick brown fox jumps over the lazy dog."] * 6)  # 54 words
USER = [{"role": "user", "content": LONG}]


def figures(found: ContextExceeded | None) -> tuple[int, int, int | None] | None:
    return None if found is None else (found.prompt_tokens, found.context, found.max_tokens)


def vllm_old(message: str) -> bytes:
    return orjson.dumps({"object": "error", "message": message, "type": "BadRequestError",
                         "param": None, "code": 400})


def nested(message: str, **error: Any) -> bytes:
    return orjson.dumps({"error": {"message": message, **error}})


STREAM_CAPTURE = fixture_path("llama-server/exceed-context-stream.http").read_bytes()
RECOGNISED = [
    ("llama-server, not streamed (the capture)",
     fixture_path("llama-server/exceed-context.json").read_bytes(), (630, 256, None)),
    ("llama-server, streamed (the capture's body)",
     STREAM_CAPTURE.partition(b"\r\n\r\n")[2], (630, 256, None)),
    ("llama-server, a prompt it cannot split, without its figures",
     nested("input (5000 tokens) is larger than the max context size (4096 tokens). skipping",
            type="exceed_context_size_error", code=400), (5000, 4096, None)),
    ("vLLM, older, with max_tokens",
     vllm_old("This model's maximum context length is 100 tokens. However, you requested 110 "
              "tokens (60 in the messages, 50 in the completion). Please reduce the length of "
              "the messages or completion."), (60, 100, 50)),
    ("vLLM, older, without max_tokens",
     vllm_old("This model's maximum context length is 100 tokens. However, you requested 130 "
              "tokens in the messages, Please reduce the length of the messages."),
     (130, 100, None)),
    ("vLLM, newer",
     nested("This model's maximum context length is 32768 tokens. However, your request has "
            "65521 input tokens. Please reduce the length of the input messages. None",
            type="BadRequestError", param=None, code=400), (65521, 32768, None)),
    ("vLLM, newer, max_tokens too large",
     nested("'max_tokens' or 'max_completion_tokens' is too large: 8000. This model's maximum "
            "context length is 4096 tokens and your request has 2778 input tokens (8000 > 4096 "
            "- 2778). None", type="BadRequestError", param=None, code=400),
     (2778, 4096, 8000)),
    ("vLLM's Messages endpoint",
     orjson.dumps({"type": "error", "error": {
         "type": "BadRequestError", "message": "This model's maximum context length is 100 "
         "tokens. However, you requested 110 tokens (60 in the messages, 50 in the completion)."
     }}), (60, 100, 50)),
    ("OpenAI's own",
     nested("This model's maximum context length is 8192 tokens. However, your messages "
            "resulted in 9000 tokens. Please reduce the length of the messages.",
            type="invalid_request_error", param="messages", code="context_length_exceeded"),
     (9000, 8192, None)),
    ("hal0d's own, a hal0d upstream",
     orjson.dumps(ContextExceeded(90, 100, 20).openai_body()), (90, 100, 20)),
    ("Anthropic's own", orjson.dumps(ContextExceeded(300, 200).anthropic_body()),
     (300, 200, None)),
]
NOT_CONTEXT = [
    ("llama-server, another 400 (a capture)",
     fixture_path("llama-server/restore-missing.json").read_bytes().partition(b" ")[2]),
    ("a parameter refused", nested("'messages' is required", type="invalid_request_error")),
    ("a word of it, no refusal of it",
     nested("the context parameter is invalid: it is too long a name", code=400)),
    ("llama's type without figures or words",
     nested("something else", type="exceed_context_size_error")),
    ("not JSON", b"the context is too long"),
    ("JSON, no object", b'["context"]'),
    ("empty", b""),
]


@pytest.mark.parametrize(("data", "expected"), [case[1:] for case in RECOGNISED],
                         ids=[case[0] for case in RECOGNISED])
def test_an_upstreams_context_error_is_read_with_its_figures(
        data: bytes, expected: tuple[int, int, int | None]) -> None:
    assert figures(context_exceeded(data)) == expected


@pytest.mark.parametrize("data", [case[1] for case in NOT_CONTEXT],
                         ids=[case[0] for case in NOT_CONTEXT])
def test_any_other_error_is_none_of_it(data: bytes) -> None:
    assert context_exceeded(data) is None


# -- through hal0d, in front of the stub ---------------------------------------------------------


@pytest.fixture
async def small(start_stub: StubFactory) -> Stub:
    """The stub as llama-server with two slots of N_CTX tokens, its Messages API native."""
    return await start_stub(slot_options=SlotOptions(ctx_size=2 * N_CTX, parallel=2),
                            anthropic_native=True)


def openai_client(hal0d: Served) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="x", max_retries=0,
                       timeout=10.0)


def anthropic_client(hal0d: Served) -> Any:
    from anthropic import AsyncAnthropic

    return AsyncAnthropic(base_url=str(hal0d.make_url("/llm")), api_key="x", max_retries=0,
                          timeout=10.0)


def refused_by_the_stub(stub: Stub, endpoint: str) -> bool:
    """The request reached the stub and its context refused it (hal0d did not)."""
    return any(f"endpoint={endpoint} status=400" in line for line in stub.lines())


async def recorded(http: aiohttp.ClientSession, hal0d: Served, request_id: str
                   ) -> dict[str, Any]:
    """The request's history row (GET /api/requests), once it is written."""
    async def row() -> dict[str, Any]:
        async with http.get(hal0d.make_url("/api/requests?limit=50")) as resp:
            rows = (await resp.json())["requests"]
        found = [r for r in rows if r["request_id"] == request_id]
        assert found, f"no row for {request_id}"
        return dict(found[0])

    return await eventually(row, 5.0, f"the history row of {request_id}")


def says_openai(error: Any, prompt: int, context: int = N_CTX) -> None:
    """The openai SDK's BadRequestError of a ContextExceeded, naming both figures."""
    assert (error.status_code, error.code, error.param, error.type) == (
        400, "context_length_exceeded", "messages", "invalid_request_error")
    assert error.body["message"].startswith(
        f"This model's maximum context length is {context} tokens. However, your messages "
        f"resulted in {prompt} tokens"), error.body


@pytest.mark.parametrize("stream", [False, True])
async def test_openai_chat_and_completions_raise_context_length_exceeded(
        small: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession,
        stream: bool) -> None:
    import openai

    hal0d = await start_hal0d(small.url)
    client = openai_client(hal0d)
    with pytest.raises(openai.BadRequestError) as chat:
        await client.chat.completions.create(model="chat", messages=USER, stream=stream)
    says_openai(chat.value, prompt_tokens({"messages": USER}))
    with pytest.raises(openai.BadRequestError) as legacy:
        await client.completions.create(model="chat", prompt=LONG, stream=stream)
    says_openai(legacy.value, len(LONG.split()) + 1)
    assert refused_by_the_stub(small, "chat") and refused_by_the_stub(small, "completions")
    for raised in (chat.value, legacy.value):
        row = await recorded(http, hal0d, raised.response.headers["X-Request-Id"])
        assert (row["status"], row["error_code"], row["stream"]) == (
            400, "context_exceeded", stream)


async def anthropic_raises(client: Any, stream: bool, **params: Any) -> Any:
    """The anthropic SDK's BadRequestError for this request, streamed or not."""
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as raised:
        if stream:
            async with client.messages.stream(**params) as events:
                [event async for event in events]
        else:
            await client.messages.create(**params)
    return raised.value


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["translate", "native"])
async def test_anthropic_messages_say_prompt_is_too_long(
        small: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession, stream: bool,
        mode: str) -> None:
    """Translated to a chat completion, or relayed to the upstream's own /v1/messages: the
    anthropic SDK gets Anthropic's words, whichever endpoint of the stub refused."""
    hal0d = await start_hal0d(small.url, slot={"anthropic": mode})
    error = await anthropic_raises(anthropic_client(hal0d), stream, model="chat",
                                   max_tokens=16, messages=USER)
    message = error.body["error"]["message"]
    assert error.body["error"]["type"] == "invalid_request_error"
    said = re.fullmatch(rf"prompt is too long: (\d+) tokens > {N_CTX} maximum", message)
    assert said is not None, message
    if mode == "native":  # the stub counted the client's own body
        assert int(said[1]) == prompt_tokens({"messages": USER})
    assert int(said[1]) > len(LONG.split())
    assert refused_by_the_stub(small, "messages" if mode == "native" else "chat")
    row = await recorded(http, hal0d, error.response.headers["X-Request-Id"])
    assert (row["status"], row["error_code"]) == (400, "context_exceeded")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("mode", ["translate", "native"])
async def test_the_responses_api_raises_context_length_exceeded(
        small: Stub, start_hal0d: ServerFactory, http: aiohttp.ClientSession, stream: bool,
        mode: str) -> None:
    import openai

    hal0d = await start_hal0d(small.url, slot={"responses": mode})
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client(hal0d).responses.create(model="chat", input=LONG, stream=stream)
    assert raised.value.code == "context_length_exceeded"
    assert f"maximum context length is {N_CTX} tokens" in raised.value.body["message"]
    if mode == "native":
        says_openai(raised.value, prompt_tokens({"messages": USER}))
    assert refused_by_the_stub(small, "responses" if mode == "native" else "chat")
    row = await recorded(http, hal0d, raised.value.response.headers["X-Request-Id"])
    assert row["error_code"] == "context_exceeded"


@pytest.mark.parametrize("stream", [False, True])
async def test_the_ollama_api_answers_400_with_the_message(
        small: Stub, start_ollama: Any, http: aiohttp.ClientSession, stream: bool) -> None:
    from ollama import AsyncClient, ResponseError

    hal0d, base = await start_ollama(small.url)
    expected = ContextExceeded(prompt_tokens({"messages": USER}), N_CTX).message
    async with http.post(f"{base}/api/chat", json={
            "model": "chat", "messages": USER, "stream": stream}) as resp:
        assert (resp.status, await resp.json()) == (400, {"error": expected})
        request_id = resp.headers["X-Request-Id"]
    with pytest.raises(ResponseError) as raised:
        await AsyncClient(host=base).generate("chat", LONG, stream=False)
    assert raised.value.status_code == 400
    assert f"maximum context length is {N_CTX} tokens" in raised.value.error
    row = await recorded(http, hal0d, request_id)
    assert (row["status"], row["error_code"]) == (400, "context_exceeded")


async def test_a_vllm_like_upstream_is_mapped_the_same(
        start_stub: StubFactory, start_hal0d: ServerFactory, http: aiohttp.ClientSession
        ) -> None:
    """vLLM weighs the prompt with max_tokens: past its max_model_len by max_tokens alone,
    Anthropic's client hears so in Anthropic's words for it; by the prompt alone, "prompt is
    too long"; the openai SDK's message names the prompt, the sum and the context."""
    import openai

    stub = await start_stub(max_model_len=MAX_MODEL_LEN)
    hal0d = await start_hal0d(stub.url)
    prompt = prompt_tokens({"messages": USER})
    assert prompt < MAX_MODEL_LEN < prompt + 60
    with pytest.raises(openai.BadRequestError) as raised:
        await openai_client(hal0d).chat.completions.create(model="chat", messages=USER,
                                                           max_tokens=60)
    says_openai(raised.value, prompt, MAX_MODEL_LEN)
    assert f"({prompt + 60} with the 60 of max_tokens" in raised.value.body["message"]
    claude = anthropic_client(hal0d)
    error = await anthropic_raises(claude, False, model="chat", max_tokens=60, messages=USER)
    assert re.fullmatch(rf"input length and `max_tokens` exceed context limit: \d+ \+ 60 > "
                        rf"{MAX_MODEL_LEN}, decrease input length or `max_tokens` and try again",
                        error.body["error"]["message"]), error.body
    twice = [{"role": "user", "content": f"{LONG} {LONG}"}]
    error = await anthropic_raises(claude, True, model="chat", max_tokens=8, messages=twice)
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {MAX_MODEL_LEN} maximum",
                        error.body["error"]["message"]), error.body
    row = await recorded(http, hal0d, error.response.headers["X-Request-Id"])
    assert row["error_code"] == "context_exceeded"


async def test_a_400_that_is_no_context_error_passes_as_it_did(
        upstream_app: Upstream, start_hal0d: ServerFactory, http: aiohttp.ClientSession
        ) -> None:
    """OpenAI's surface relays it byte for byte, streamed or not; Anthropic's gives its message
    in Anthropic's envelope; the history says upstream_status_400."""
    import anthropic

    said = (b'{"error":{"message":"temperature must be at most 2 (the context of this rule is '
            b'too long to quote)","type":"invalid_request_error","param":"temperature",'
            b'"code":null}}')

    async def refuse(_: web.Request) -> web.Response:
        return web.Response(body=said, status=400, content_type="application/json")

    hal0d = await start_hal0d(await upstream_app({"POST /v1/chat/completions": refuse}))
    for stream in (False, True):
        async with http.post(hal0d.make_url("/v1/chat/completions"), json={
                "model": "chat", "messages": USER, "stream": stream}) as resp:
            status, body = resp.status, await resp.read()
            request_id = resp.headers["X-Request-Id"]
        assert (status, body) == (400, said)
        assert (await recorded(http, hal0d, request_id))["error_code"] == "upstream_status_400"
    with pytest.raises(anthropic.BadRequestError) as raised:
        await anthropic_client(hal0d).messages.create(model="chat", max_tokens=8, messages=USER)
    assert raised.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "slot 'llm': temperature must be at most 2 (the context of this rule is too "
                   "long to quote)"}


async def test_after_a_keepalive_the_anthropic_stream_ends_in_its_own_words(
        start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """The head and message_start are out while the model loads: the refusal that follows is
    the stream's `event: error`, with Anthropic's "prompt is too long" in it."""
    slot = on_demand("a", tmp_path, "-c", str(2 * N_CTX), "-np", "2", "--startup-delay", "1",
                     keepalive_s=0.2)
    hal0d = await start(start_hal0d, build_config(tmp_path, slot))
    async with http.post(hal0d.make_url("/v1/messages"), json={
            "model": "chat", "max_tokens": 8, "messages": USER, "stream": True}) as resp:
        status, body = resp.status, await resp.read()
        request_id = resp.headers["X-Request-Id"]
    assert status == 200 and body.startswith(b"event: message_start"), body
    last = body.rstrip().rsplit(b"\n\n", 1)[-1]
    event, data = last.split(b"\n")
    assert event == b"event: error", body
    error = orjson.loads(data.removeprefix(b"data: "))["error"]
    assert error["type"] == "invalid_request_error"
    assert re.fullmatch(rf"prompt is too long: \d+ tokens > {N_CTX} maximum", error["message"])
    assert (await recorded(http, hal0d, request_id))["error_code"] == "context_exceeded"


async def test_a_real_hal0d_serve_maps_its_slots_own_refusals(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """`hal0d serve`, its slots the stub as llama-server (-c 64 -np 2) and as vLLM
    (--max-model-len), each started with hal0d by its command line."""
    import openai

    slots = ""
    for name, model, flags in (("llama", "chat", ("-c", str(2 * N_CTX), "-np", "2")),
                               ("vllm", "reasoning", ("--max-model-len", str(MAX_MODEL_LEN)))):
        stub_port = free_port()
        command = stub_command(stub_port, tmp_path / f"{name}.log", *flags)
        slots += textwrap.dedent(f"""
            [[slots]]
            name = "{name}"
            upstream = "http://127.0.0.1:{stub_port}"
            models = ["{model}"]
            command = {orjson.dumps(command).decode()}
        """)
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(config_text("unused", port, tmp_path, slot=slots))
    async with serving(config, port) as hal0d:
        await eventually(lambda: ready(http, hal0d), 15.0, "both slots ready")
        client = openai_client(hal0d)
        twice = [{"role": "user", "content": f"{LONG} {LONG}"}]
        for model, context, messages in (("chat", N_CTX, USER),
                                         ("reasoning", MAX_MODEL_LEN, twice)):
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as raised:
                    await client.chat.completions.create(model=model, messages=messages,
                                                         stream=stream)
                says_openai(raised.value, prompt_tokens({"messages": messages}), context)
                row = await recorded(http, hal0d, raised.value.response.headers["X-Request-Id"])
                assert (row["status"], row["error_code"]) == (400, "context_exceeded")


async def ready(http: aiohttp.ClientSession, hal0d: Served) -> bool:
    async with http.get(hal0d.make_url("/api/slots")) as resp:
        return all(view["state"] == "ready" for view in (await resp.json())["slots"])

