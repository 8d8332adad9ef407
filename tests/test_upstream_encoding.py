"""Compressed answers over real sockets: hal0d reads what it relays (usage, the metrics tap, the
translated surfaces), so it asks every upstream for uncompressed bytes; an upstream that
compresses anyway has its Content-Encoding relayed with its bytes, which its client can read.

The upstreams compress as nginx in front of a llama-server does: whenever the request's
Accept-Encoding allows it (aiohttp's enable_compression), or whatever it says.
"""

from __future__ import annotations

import gzip
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web

from tests.harness.client import chat_body
from tests.harness.poll import eventually
from tests.harness.stubs import content_chunk

ANSWER = {
    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "chat",
    "choices": [{"index": 0, "finish_reason": "stop",
                 "message": {"role": "assistant", "content": "Hello there"}}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13},
}
USAGE_CHUNK = b"data: " + orjson.dumps({
    "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 11, "completion_tokens": 2, "total_tokens": 13}}) + b"\n\n"
STREAM = [content_chunk("Hello"), content_chunk(" there"), USAGE_CHUNK, b"data: [DONE]\n\n"]
MESSAGES = {"model": "chat", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def compressing(accepted: list[str], *, force: bool = False):
    """A chat completions upstream that gzips its answers when the request allows it (or, with
    `force`, always); each request's Accept-Encoding into `accepted`."""

    async def chat(request: web.Request) -> web.StreamResponse:
        accepted.append(request.headers.get(hdrs.ACCEPT_ENCODING, ""))
        body: dict[str, Any] = await request.json()
        if body.get("stream"):
            response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        else:
            response = web.json_response(ANSWER)
        response.enable_compression(web.ContentCoding.gzip if force else None)
        if not body.get("stream"):
            return response
        await response.prepare(request)
        for piece in STREAM:
            await response.write(piece)
        await response.write_eof()
        return response

    return chat


async def last_row(http: aiohttp.ClientSession, hal0d: Any) -> dict[str, Any]:
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        rows: list[dict[str, Any]] = (await resp.json())["requests"]
    return rows[0]


async def test_an_upstream_that_compresses_when_allowed_is_asked_for_identity(
    upstream_app, start_hal0d, http
):
    """A whole answer and a stream through the OpenAI surface arrive readable, with their usage
    recorded; every request hal0d made asked for identity, whatever the client accepted."""
    accepted: list[str] = []
    url = await upstream_app({"POST /v1/chat/completions": compressing(accepted)})
    hal0d = await start_hal0d(url, models=("chat",))
    async with aiohttp.ClientSession(auto_decompress=False) as raw:
        async with raw.post(hal0d.make_url("/v1/chat/completions"),
                            json=chat_body("chat", stream=False),
                            headers={hdrs.ACCEPT_ENCODING: "gzip, deflate, br"}) as resp:
            assert resp.status == 200
            assert hdrs.CONTENT_ENCODING not in resp.headers
            assert orjson.loads(await resp.read()) == ANSWER
        row = await eventually(lambda: last_row(http, hal0d), 5.0, "the answer's row")
        assert (row["prompt_tokens"], row["completion_tokens"]) == (11, 2)

        async with raw.post(hal0d.make_url("/v1/chat/completions"), json=chat_body("chat"),
                            headers={hdrs.ACCEPT_ENCODING: "gzip"}) as resp:
            assert resp.status == 200
            assert hdrs.CONTENT_ENCODING not in resp.headers
            assert await resp.read() == b"".join(STREAM)

    async def stream_row() -> dict[str, Any]:
        row = await last_row(http, hal0d)
        assert row["stream"], row
        return row

    row = await eventually(stream_row, 5.0, "the stream's row")
    assert (row["ok"], row["prompt_tokens"], row["completion_tokens"]) == (1, 11, 2)
    assert accepted == ["identity", "identity"]


async def test_a_translated_answer_of_an_upstream_that_compresses_when_allowed_is_not_a_502(
    upstream_app, start_hal0d, http
):
    accepted: list[str] = []
    url = await upstream_app({"POST /v1/chat/completions": compressing(accepted)})
    hal0d = await start_hal0d(url, models=("chat",))
    async with http.post(hal0d.make_url("/v1/messages"), json=MESSAGES) as resp:
        assert resp.status == 200, await resp.text()
        message = await resp.json()
    assert message["content"] == [{"type": "text", "text": "Hello there"}]
    assert message["usage"]["output_tokens"] == 2
    assert accepted == ["identity"]


async def test_an_upstream_that_compresses_regardless_has_its_encoding_relayed(
    upstream_app, start_hal0d, http
):
    """The bytes are passed on as they came, and so is what they are: the client decodes them."""
    url = await upstream_app({"POST /v1/chat/completions": compressing([], force=True)})
    hal0d = await start_hal0d(url, models=("chat",))
    async with aiohttp.ClientSession(auto_decompress=False) as raw, raw.post(
        hal0d.make_url("/v1/chat/completions"), json=chat_body("chat", stream=False)
    ) as resp:
        assert resp.status == 200
        assert resp.headers[hdrs.CONTENT_ENCODING] == "gzip"
        data = await resp.read()
    assert data[:2] == b"\x1f\x8b" and orjson.loads(gzip.decompress(data)) == ANSWER
    # aiohttp's client, as any other, reads it by the header.
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat", stream=False)) as resp:
        assert resp.status == 200
        assert await resp.json() == ANSWER
