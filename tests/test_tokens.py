"""Prompt token counting through the upstream's tokenizer, over real sockets."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from hal0d.config import SlotConfig
from hal0d.transport.tokens import TEMPLATE, TokenCounter, estimate
from hal0d.transport.upstream import UpstreamClient

PAYLOAD = {"model": "m", "messages": [{"role": "user", "content": "one two three"}]}
TEMPLATED = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
             "<|im_start|>user\none two three<|im_end|>\n<|im_start|>assistant\n")


async def test_a_passing_failure_is_not_remembered_as_no_tokenizer(upstream_app):
    answers = [web.json_response({"error": "Loading model"}, status=503),
               web.json_response({"tokens": [1, 2, 3, 4, 5]})]
    calls = []

    async def tokenize(request: web.Request) -> web.Response:
        calls.append(await request.json())
        return answers[min(len(calls), len(answers)) - 1]

    url = await upstream_app({"POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        first = await counter.count(slot, PAYLOAD, "one two three")
        second = await counter.count(slot, PAYLOAD, "one two three")
    assert first == (estimate("one two three"), "estimate")
    assert second == (5, "tokenize")
    assert len(calls) == 2


async def test_an_upstream_without_a_tokenizer_is_asked_once(upstream_app):
    asked = []

    async def absent(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"detail": "Not Found"}, status=404)

    url = await upstream_app({"POST /{tail:.*}": absent})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        results = [await counter.count(slot, PAYLOAD, "a" * 40) for _ in range(3)]
    assert results == [(10, "estimate")] * 3
    assert asked == ["/apply-template", "/tokenize", "/extras/tokenize/count"]


async def test_the_combined_body_reaches_vllm_and_llama_server_shapes(upstream_app):
    seen = {}

    async def tokenize(request: web.Request) -> web.Response:
        seen.update(await request.json())
        return web.json_response({"count": 12, "tokens": [0] * 12, "max_model_len": 4096})

    url = await upstream_app({"POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        assert await counter.count(slot, PAYLOAD, "one two three") == (
            12, "tokenize")
    assert seen["messages"] == PAYLOAD["messages"] and seen["content"] == "one two three"


async def test_llama_server_counts_its_templated_prompt_with_the_completions_special_tokens(
    upstream_app,
):
    seen: dict[str, dict] = {}

    async def template(request: web.Request) -> web.Response:
        seen["template"] = await request.json()
        return web.json_response({"prompt": TEMPLATED})

    async def tokenize(request: web.Request) -> web.Response:
        seen["tokenize"] = await request.json()
        return web.json_response({"tokens": [0] * 21})

    url = await upstream_app({"POST /apply-template": template, "POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    with_tools = {**PAYLOAD, "tools": [{"type": "function", "function": {"name": "f"}}]}
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        assert await counter.count(slot, with_tools, "one two three") == (
            21, "template")
    assert seen["template"] == with_tools  # the template renders the tools too
    assert seen["tokenize"] == {"content": TEMPLATED, "add_special": True, "parse_special": True}


async def test_an_upstream_without_apply_template_costs_one_404_then_tokenize_as_before(
    upstream_app,
):
    asked = []

    async def absent(request: web.Request) -> web.Response:
        asked.append(request.path)
        return web.json_response({"error": {"code": 404, "message": "File Not Found"}}, status=404)

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(request.path)
        body = await request.json()
        return web.json_response({"tokens": [0] * len(body["content"].split())})

    url = await upstream_app({"POST /apply-template": absent, "POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        results = [await counter.count(slot, PAYLOAD, "one two three") for _ in range(3)]
    assert results == [(3, "tokenize")] * 3
    assert asked == ["/apply-template", "/tokenize", "/tokenize", "/tokenize"]


async def test_a_request_the_template_refuses_is_counted_raw_and_the_template_kept(upstream_app):
    answers = [web.json_response({"error": {"code": 400, "message": "bad tools"}}, status=400),
               web.json_response({"prompt": TEMPLATED})]
    asked = []

    async def template(request: web.Request) -> web.Response:
        asked.append(request.path)
        return answers[min(asked.count(TEMPLATE), len(answers)) - 1]

    async def tokenize(request: web.Request) -> web.Response:
        asked.append(request.path)
        body = await request.json()
        return web.json_response({"tokens": [0] * len(body["content"].split())})

    url = await upstream_app({"POST /apply-template": template, "POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        first = await counter.count(slot, PAYLOAD, "one two three")
        second = await counter.count(slot, PAYLOAD, "one two three")
    assert first == (3, "tokenize")  # this request only: a 400 is not "no such endpoint"
    assert second == (len(TEMPLATED.split()), "template")
    assert asked == [TEMPLATE, "/tokenize", TEMPLATE, "/tokenize"]
