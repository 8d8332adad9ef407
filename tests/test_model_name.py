"""The OpenAI surface names the model the client asked for, whatever the upstream calls it.

llama-server started without --alias names its model by the file's path (the captures in
tests/fixtures/llama-server/ do: `/tmp/hal0d-harness/llama-server/SmolLM2-...gguf`). An upstream
replays those captures here, over real sockets, to the openai SDK: streamed and whole, chat
completions and legacy completions, every read cut in two so the field is split across reads.
"""

from __future__ import annotations

import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d.openai.transform import Passthrough
from tests.fixtures_util import fixture_path
from tests.harness.daemons import ServerFactory
from tests.harness.stubs import Upstream
from tests.llama_server_capture import PREFILL_PINGS, PREFILL_TEXT, read_capture

ASKED = "smollm2"
PATH = b'"/tmp/hal0d-harness/llama-server/SmolLM2-135M-Instruct.Q4_1.gguf"'


def legacy(chunk: bytes) -> bytes:
    """A chat capture's bytes as a legacy completion's (the same model field)."""
    return chunk.replace(b'"chat.completion.chunk"', b'"text_completion"').replace(
        b'"chat.completion"', b'"text_completion"')


async def replaying(request: web.Request) -> web.StreamResponse:
    """llama-server's captured answers, the model named by its path."""
    body = await request.json()
    edit = legacy if request.path.endswith("/v1/completions") else bytes
    if not body.get("stream"):
        whole = fixture_path("llama-server/chat-cold.json").read_bytes()
        return web.Response(body=edit(whole), content_type="application/json")
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for chunk in read_capture(PREFILL_PINGS).chunks:
        cut = chunk.find(b'"model":"') + 20  # the field split between two writes
        for part in (chunk[:cut], chunk[cut:]):
            if part:
                await response.write(edit(part))
    return response


@pytest.fixture
async def hal0d(start_hal0d: ServerFactory, upstream_app: Upstream) -> TestServer:
    upstream = await upstream_app({"POST /v1/chat/completions": replaying,
                                   "POST /v1/completions": replaying})
    assert PATH in fixture_path("llama-server/chat-cold.json").read_bytes()
    return await start_hal0d(upstream, models=(ASKED,))


def sdk(hal0d: TestServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="x", max_retries=0)


async def test_a_chat_answer_names_the_asked_model_streamed_and_whole(hal0d: TestServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    whole = await sdk(hal0d).chat.completions.create(model=ASKED, messages=messages)  # type: ignore[arg-type]
    assert whole.model == ASKED and whole.choices[0].message.content == "I'm glad to"
    assert whole.usage is not None and whole.usage.prompt_tokens == 900
    stream = await sdk(hal0d).chat.completions.create(model=ASKED, messages=messages,  # type: ignore[arg-type]
                                                      stream=True)
    chunks = [chunk async for chunk in stream]
    assert chunks and {chunk.model for chunk in chunks} == {ASKED}
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == PREFILL_TEXT


async def test_a_legacy_completion_names_the_asked_model_streamed_and_whole(
    hal0d: TestServer
) -> None:
    whole = await sdk(hal0d).completions.create(model=ASKED, prompt="hi")
    assert whole.model == ASKED
    stream = await sdk(hal0d).completions.create(model=ASKED, prompt="hi", stream=True)
    assert {chunk.model async for chunk in stream} == {ASKED}


def test_the_rename_holds_for_any_split_of_the_stream_and_leaves_the_rest_as_it_came() -> None:
    body = read_capture(PREFILL_PINGS).body
    expected = body.replace(b'"model":' + PATH, b'"model":"' + ASKED.encode() + b'"')
    assert expected != body
    for cut in range(1, len(body), 7):
        for second in (cut + 1, cut + 90, len(body)):
            transform = Passthrough(sse=True, legacy_completion=False, model=ASKED,
                                    expect_done=True)
            out = b"".join(transform.feed(part) for part in
                           (body[:cut], body[cut:second], body[second:]))
            assert out + transform.end() == expected, (cut, second)
    same = Passthrough(sse=True, legacy_completion=False, model="/tmp/hal0d-harness/llama-server/"
                       "SmolLM2-135M-Instruct.Q4_1.gguf", expect_done=True)
    assert same.feed(body) == body  # the upstream names the asked model: nothing is touched
    assert orjson.loads(PATH) != ASKED
