"""How much of each prompt the upstream took from its prompt cache, seen everywhere hal0d shows a
request: the history row in the SQLite file, the request.done line, `/metrics`, `/api/slots/
metrics`, and what the anthropic SDK reads (`usage.cache_read_input_tokens`).

The upstream is a plain aiohttp app on a real port answering as llama-server does: its whole
answers are the captures tests/fixtures/llama-server/chat-warm.json (a prompt of 917 tokens, 903
from the cache) and chat-cold.json (900, none cached); its streams are those answers in the
chunks llama-server's source writes (tools/server/server-task.cpp, to_json_oaicompat_chat_stream):
a role-only chunk, one chunk per piece of text, the finish, with include_usage a `"choices": []`
chunk with the usage; `timings` on the last of them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import pytest
from aiohttp import hdrs, web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import RUNTIME
from tests.fixtures_util import fixture_path
from tests.harness.observe import db_row, scrape, slot_metrics, value
from tests.harness.poll import eventually

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

CHAT = "/v1/chat/completions"
CAPTURES = {name: orjson.loads(fixture_path(f"llama-server/chat-{name}.json").read_bytes())
            for name in ("warm", "cold")}
# The captures' figures: (prompt_tokens, cached_tokens).
WARM, COLD = (917, 903), (900, 0)


def llama_server_chunks(answer: dict[str, Any], *, include_usage: bool) -> list[bytes]:
    """`answer` (a captured whole answer) as llama-server streams it."""
    head = {"created": answer["created"], "id": answer["id"], "model": answer["model"],
            "system_fingerprint": answer["system_fingerprint"],
            "object": "chat.completion.chunk"}
    choice = answer["choices"][0]
    text = choice["message"]["content"]
    pieces = [text[:3], text[3:]]
    chunks: list[dict[str, Any]] = [
        {"choices": [{"finish_reason": None, "index": 0,
                      "delta": {"role": "assistant", "content": None}}], **head},
        *({"choices": [{"finish_reason": None, "index": 0, "delta": {"content": piece}}],
           **head} for piece in pieces),
        {"choices": [{"finish_reason": choice["finish_reason"], "index": 0, "delta": {}}],
         **head},
    ]
    if include_usage:
        chunks.append({"choices": [], **head, "usage": answer["usage"]})
    chunks[-1]["timings"] = answer["timings"]
    return [b"data: " + orjson.dumps(chunk) + b"\n\n" for chunk in chunks] + [b"data: [DONE]\n\n"]


async def llama_server(request: web.Request) -> web.StreamResponse:
    """The model named "warm" answers chat-warm.json, any other chat-cold.json."""
    body = await request.json()
    answer = CAPTURES["warm" if body.get("model") == "warm" else "cold"]
    if not body.get("stream"):
        return web.json_response(answer)
    options = body.get("stream_options") or {}
    response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
    await response.prepare(request)
    for chunk in llama_server_chunks(answer, include_usage=bool(options.get("include_usage"))):
        await response.write(chunk)
    await response.write_eof()
    return response


@pytest.fixture
async def hal0d(upstream_app: Any, start_hal0d: Any) -> TestServer:
    url = await upstream_app({f"POST {CHAT}": llama_server})
    server: TestServer = await start_hal0d(url, models=("warm", "cold"))
    return server


def ask(model: str, *, stream: bool) -> dict[str, Any]:
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]}


async def chat(http: aiohttp.ClientSession, hal0d: TestServer, request_id: str,
               body: dict[str, Any]) -> bytes:
    async with http.post(hal0d.make_url(CHAT), json=body,
                         headers={"X-Request-Id": request_id}) as resp:
        assert resp.status == 200
        return await resp.read()


async def figures(hal0d: TestServer, request_id: str) -> tuple[int, int]:
    """(prompt_tokens, cached_tokens) as the request's row in the SQLite file holds them."""
    row = await db_row(hal0d.app[RUNTIME].current.config.database_path(), request_id)
    return row["prompt_tokens"], row["cached_tokens"]


# -- the history row and the request.done line ---------------------------------------------------


async def test_a_whole_answers_cached_part_is_in_its_history_row_and_request_done_line(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    with capture_logs() as logs:
        await chat(http, hal0d, "whole-warm", ask("warm", stream=False))
        await chat(http, hal0d, "whole-cold", ask("cold", stream=False))

        def done() -> dict[str, Any]:
            lines = {e["request_id"]: e for e in logs if e["event"] == "request.done"}
            assert {"whole-warm", "whole-cold"} <= set(lines), lines
            return lines

        lines = await eventually(done, 2.0, "the request.done lines")
    assert await figures(hal0d, "whole-warm") == WARM
    assert await figures(hal0d, "whole-cold") == COLD  # said: none cached, not unknown
    assert (lines["whole-warm"]["prompt_tokens"], lines["whole-warm"]["cached_tokens"]) == WARM


@pytest.mark.parametrize("include_usage", [False, True], ids=["timings alone", "usage chunk"])
async def test_a_streams_cached_part_is_in_its_history_row_with_timings_on_the_last_chunk(
    include_usage: bool, hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    """Without include_usage llama-server's only word of its cache is `timings` on the finish
    chunk; with it, the usage chunk carries both."""
    body = ask("warm", stream=True)
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    raw = await chat(http, hal0d, "stream-warm", body)
    assert raw == b"".join(llama_server_chunks(CAPTURES["warm"], include_usage=include_usage))
    assert await figures(hal0d, "stream-warm") == WARM


# -- /metrics and /api/slots/metrics -------------------------------------------------------------


async def test_prompt_tokens_read_and_cached_are_counted_per_slot(
    hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    before = await scrape(http, hal0d)
    assert value(before, "hal0d_prompt_tokens_total", slot="llm", source="read") is None
    await chat(http, hal0d, "m1", ask("warm", stream=False))
    await chat(http, hal0d, "m2", ask("cold", stream=True))  # timings alone
    await chat(http, hal0d, "m3", ask("warm", stream=True))
    live = await slot_metrics(http, hal0d, requests=3)
    read = (WARM[0] - WARM[1]) * 2 + COLD[0]
    cached = WARM[1] * 2
    assert live["prompt_tokens"] == {"read": read, "cached": cached}
    after = await scrape(http, hal0d)
    assert value(after, "hal0d_prompt_tokens_total", slot="llm", source="read") == read
    assert value(after, "hal0d_prompt_tokens_total", slot="llm", source="cached") == cached


async def test_an_upstream_that_says_nothing_of_a_cache_counts_no_prompt_tokens(
    upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """llama-cpp-python's answer (its capture) has prompt_tokens and no word of a cache: no
    figure, not a cache that held nothing (its share on the page would be a false 0 %)."""
    silent = fixture_path("llama-cpp-python-0.3.36-smollm2-nonstream.json").read_bytes()

    async def answer(_: web.Request) -> web.Response:
        return web.Response(body=silent, content_type="application/json")

    hal0d = await start_hal0d(await upstream_app({f"POST {CHAT}": answer}), models=("smol",))
    await chat(http, hal0d, "s1", ask("smol", stream=False))
    assert await figures(hal0d, "s1") == (36, None)
    live = await slot_metrics(http, hal0d)
    assert live["prompt_tokens"] == {"read": 0, "cached": 0}
    samples = await scrape(http, hal0d)
    assert value(samples, "hal0d_prompt_tokens_total", slot="llm", source="read") is None


# -- the Anthropic surface -----------------------------------------------------------------------


@pytest.fixture
async def client(hal0d: TestServer) -> AsyncIterator[AsyncAnthropic]:
    from anthropic import AsyncAnthropic

    async with AsyncAnthropic(base_url=str(hal0d.make_url("/llm")), api_key="x",
                              max_retries=0, timeout=10.0) as sdk:
        yield sdk


HI = [{"role": "user", "content": "hi"}]


async def test_the_anthropic_sdk_reads_the_cached_part_of_a_whole_answer(
    client: AsyncAnthropic,
) -> None:
    message = await client.messages.create(model="warm", max_tokens=4, messages=HI)
    assert message.content[0].text == CAPTURES["warm"]["choices"][0]["message"]["content"]  # type: ignore[union-attr]
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (WARM[0] - WARM[1], WARM[1])
    assert usage.output_tokens == 4


async def test_the_anthropic_sdk_reads_the_cached_part_of_a_stream_and_so_does_the_history(
    client: AsyncAnthropic, hal0d: TestServer
) -> None:
    async with client.messages.stream(model="warm", max_tokens=4, messages=HI,
                                      extra_headers={"X-Request-Id": "anthropic-warm"}) as stream:
        message = await stream.get_final_message()
    usage = message.usage
    assert (usage.input_tokens, usage.cache_read_input_tokens) == (WARM[0] - WARM[1], WARM[1])
    assert await figures(hal0d, "anthropic-warm") == WARM  # the whole prompt and its cached part


async def test_translated_whole_answers_keep_the_whole_prompt_and_its_cached_part_in_the_row(
    upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """An Anthropic Messages answer says the cached part beside what was read, and a translated
    Responses answer in input_tokens_details: the row holds the whole prompt and the cached part
    either way, as for a chat completion."""
    url = await upstream_app({f"POST {CHAT}": llama_server})
    hal0d = await start_hal0d(url, models=("warm",), slot={"responses": "translate"})
    async with http.post(hal0d.make_url("/v1/messages"), json={
            "model": "warm", "max_tokens": 4, "messages": HI},
            headers={"X-Request-Id": "messages-warm"}) as resp:
        usage = (await resp.json())["usage"]
        assert resp.status == 200
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (
        WARM[0] - WARM[1], WARM[1])
    assert await figures(hal0d, "messages-warm") == WARM
    async with http.post(hal0d.make_url("/v1/responses"), json={
            "model": "warm", "input": "hi"}, headers={"X-Request-Id": "responses-warm"}) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
    assert answer["usage"]["input_tokens_details"]["cached_tokens"] == WARM[1]
    assert await figures(hal0d, "responses-warm") == WARM
