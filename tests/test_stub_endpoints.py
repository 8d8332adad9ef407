"""The stub serves what docs/endpoints.md lists, through hal0d over real sockets: every endpoint
of the Endpoints table with a correctly shaped answer, bodies as large as hal0d accepts, the same
misbehaviour per model streamed or not, and its own errors in the OpenAI envelope."""

from __future__ import annotations

import base64
import struct
import zlib
from typing import Any

import aiohttp
import pytest

from hal0d.config import ConfigError, parse
from hal0d_stub.app import MAX_BODY_BYTES
from hal0d_stub.slots import SlotOptions
from tests.harness.client import chat_body

MIB = 1024 * 1024


def form(audio: bytes, model: str = "chat", **fields: str) -> aiohttp.FormData:
    data = aiohttp.FormData()
    data.add_field("file", audio, filename="hello.wav", content_type="audio/wav")
    data.add_field("model", model)
    for name, value in fields.items():
        data.add_field(name, value)
    return data


def png_size(png: bytes) -> tuple[int, int]:
    """Width and height of a PNG, after checking it decodes: signature, IHDR, the pixel rows."""
    assert png.startswith(b"\x89PNG\r\n\x1a\n"), png[:16]
    width, height = struct.unpack(">II", png[16:24])
    idat_at = png.index(b"IDAT")
    length = struct.unpack(">I", png[idat_at - 4:idat_at])[0]
    rows = zlib.decompress(png[idat_at + 4:idat_at + 4 + length])
    assert len(rows) == height * (1 + width)  # greyscale, one filter byte per row
    assert png.endswith(b"IEND\xaeB`\x82")
    return width, height


async def test_image_generations_answer_openai_shape_with_a_real_png(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    body = {"model": "chat", "prompt": "a grey square", "n": 2}
    async with http.post(hal0d.make_url("/v1/images/generations"), json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"
        answer = await resp.json()
    assert isinstance(answer["created"], int)
    assert len(answer["data"]) == 2
    assert png_size(base64.b64decode(answer["data"][0]["b64_json"])) == (8, 8)


async def test_rerank_results_are_ordered_by_score_and_honour_top_n(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    documents = ["bananas are yellow", "the weather in paris today", "paris in spring"]
    body = {"model": "chat", "query": "weather in paris", "documents": documents, "top_n": 2,
            "return_documents": True}
    async with http.post(hal0d.make_url("/v1/rerank"), json=body) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == "application/json"
        answer = await resp.json()
    results = answer["results"]
    assert [r["index"] for r in results] == [1, 2]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[1] > 0
    assert results[0]["document"] == {"text": documents[1]}
    body.pop("top_n")
    async with http.post(hal0d.make_url("/llm/v1/rerank"), json=body) as resp:
        assert [r["index"] for r in (await resp.json())["results"]] == [1, 2, 0]


async def test_rerank_without_documents_is_a_400_in_the_openai_envelope(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    body = {"model": "chat", "query": "q", "documents": []}
    async with http.post(hal0d.make_url("/v1/rerank"), json=body) as resp:
        assert resp.status == 400
        assert resp.content_type == "application/json"
        assert "documents" in (await resp.json())["error"]["message"]


@pytest.mark.parametrize(("response_format", "content_type"),
                         [("json", "application/json"), ("text", "text/plain")])
async def test_transcriptions_answer_the_multipart_upload(
    stub, start_hal0d, http, response_format, content_type
):
    hal0d = await start_hal0d(stub.url)
    data = form(b"RIFF" + bytes(1000), response_format=response_format)
    async with http.post(hal0d.make_url("/v1/audio/transcriptions"), data=data) as resp:
        assert resp.status == 200, await resp.text()
        assert resp.content_type == content_type
        text = (await resp.json())["text"] if response_format == "json" else await resp.text()
    assert "1004 bytes of audio/wav" in text


async def test_every_endpoint_of_the_readme_is_served_and_logged(stub, start_hal0d, http):
    """Each endpoint through hal0d: 200, the content type of its kind, and the stub's request log
    names it with a start and an end."""
    hal0d = await start_hal0d(stub.url)
    json_calls: list[tuple[str, dict[str, Any], str]] = [
        ("chat/completions", chat_body(stream=False), "application/json"),
        ("chat/completions", chat_body(), "text/event-stream"),
        ("completions", {"model": "chat", "prompt": "hi"}, "application/json"),
        ("completions", {"model": "chat", "prompt": "hi", "stream": True}, "text/event-stream"),
        ("embeddings", {"model": "chat", "input": ["a", "b"]}, "application/json"),
        ("audio/speech", {"model": "chat", "input": "hi", "voice": "x"}, "audio/wav"),
        ("images/generations", {"model": "chat", "prompt": "p"}, "application/json"),
        ("rerank", {"model": "chat", "query": "q", "documents": ["q"]}, "application/json"),
    ]
    for endpoint, body, content_type in json_calls:
        async with http.post(hal0d.make_url(f"/v1/{endpoint}"), json=body) as resp:
            assert (resp.status, resp.content_type) == (200, content_type), endpoint
            assert await resp.read()
    async with http.post(hal0d.make_url("/v1/audio/transcriptions"), data=form(b"x")) as resp:
        assert (resp.status, resp.content_type) == (200, "application/json")
    names = {"chat", "completions", "embeddings", "speech", "images", "rerank", "transcriptions"}
    for name in names:
        events = [line.split()[1] for line in stub.lines() if f"endpoint={name}" in line]
        assert events and events.count("start") == events.count("end"), (name, stub.lines())


def test_the_stub_takes_any_body_hal0d_accepts():
    """The stub's limit is hal0d's largest max_body_bytes: one byte more is refused by hal0d."""
    assert parse({"server": {"max_body_bytes": MAX_BODY_BYTES}}).server.max_body_bytes == (
        MAX_BODY_BYTES
    )
    with pytest.raises(ConfigError):
        parse({"server": {"max_body_bytes": MAX_BODY_BYTES + 1}})


async def test_a_20_mib_body_goes_through_hal0d_to_the_stub(start_stub, start_hal0d, http):
    """hal0d allows 32 MiB by default; the stub used to refuse anything over aiohttp's 1 MiB.
    Its four million words need a context that holds them (the stub's largest)."""
    stub = await start_stub(slot_options=SlotOptions(ctx_size=1 << 24))
    hal0d = await start_hal0d(stub.url)
    audio = bytes(20 * MIB)
    async with http.post(hal0d.make_url("/v1/audio/transcriptions"), data=form(audio)) as resp:
        assert resp.status == 200, await resp.text()
        assert f"{len(audio)} bytes" in (await resp.json())["text"]
    big = chat_body(stream=False, content="word " * (4 * MIB))  # 20 MiB of JSON
    async with http.post(hal0d.make_url("/v1/chat/completions"), json=big) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
    assert answer["choices"][0]["message"]["content"]
    assert answer["usage"]["prompt_tokens"] > 4 * MIB


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions", chat_body("broken", stream=False)),
    ("/v1/images/generations", {"model": "broken", "prompt": "p"}),
    ("/llm/v1/messages", {"model": "broken", "max_tokens": 8,
                          "messages": [{"role": "user", "content": "hi"}]}),
])
async def test_a_non_streamed_broken_answer_is_a_clean_502_in_the_envelope(
    stub, start_hal0d, http, path, body
):
    """`broken` cuts the connection mid-body when not streamed too; hal0d answers a 502 in the
    client's envelope, never a 500, and the slot is free for the next request."""
    hal0d = await start_hal0d(stub.url)
    async with http.post(hal0d.make_url(path), json=body) as resp:
        assert resp.status == 502, await resp.text()
        assert resp.content_type == "application/json"
        answer = await resp.json()
    if path.startswith("/llm"):
        assert answer["type"] == "error" and answer["error"]["type"] == "api_error", answer
    else:
        assert answer["error"]["code"] == "dispatch.upstream_unavailable", answer
    assert any(line.split()[1] == "breaking" for line in stub.lines()), stub.lines()
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body(stream=False)) as resp:
        assert resp.status == 200


async def test_the_tool_model_calls_the_tool_streamed_or_not(stub, start_hal0d, http):
    hal0d = await start_hal0d(stub.url)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    url = hal0d.make_url("/v1/chat/completions")
    async with http.post(url, json=chat_body("tool", stream=False, tools=tools)) as resp:
        choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    async with http.post(url, json=chat_body("tool", tools=tools)) as resp:
        raw = await resp.text()
    assert '"name":"get_weather"' in raw and '"finish_reason":"tool_calls"' in raw


@pytest.mark.parametrize(("method", "path", "status"), [
    ("POST", "/v1/no-such-endpoint", 404),
    ("GET", "/v1/chat/completions", 405),
])
async def test_the_stubs_own_errors_are_json_in_the_openai_envelope(stub, http, method, path,
                                                                     status):
    async with http.request(method, stub.url + path, json={}) as resp:
        assert resp.status == status
        assert resp.content_type == "application/json"
        error = (await resp.json())["error"]
    assert isinstance(error["message"], str) and error["type"]
