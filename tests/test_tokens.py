"""Prompt token counting through the upstream's tokenizer, over real sockets."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web
from structlog.testing import capture_logs

from hal0d.config import SlotConfig
from hal0d.transport import tokens
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


def slow_tokenizer(delays: list[float]):
    """A /tokenize that answers five tokens after the next of `delays` (the last one repeats)."""
    calls = 0

    async def tokenize(request: web.Request) -> web.Response:
        nonlocal calls
        calls += 1
        await asyncio.sleep(delays[min(calls, len(delays)) - 1])
        return web.json_response({"tokens": [1, 2, 3, 4, 5]})

    return tokenize


async def test_a_slots_first_count_has_the_time_a_cold_tokenizer_needs(
    upstream_app, monkeypatch: pytest.MonkeyPatch
):
    """After a load a tokenizer's first answer can be slow: the first count waits for it where
    any other would be an estimate, and says so at info with its cause. A count its caller says
    follows a load is a first count again."""
    monkeypatch.setattr(tokens, "TOKENIZE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(tokens, "FIRST_COUNT_TIMEOUT_S", 1.0)
    url = await upstream_app({"POST /tokenize": slow_tokenizer([0.3])})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        with capture_logs() as logs:
            first = await counter.count(slot, PAYLOAD, "one two three")
            later = await counter.count(slot, PAYLOAD, "one two three")
            reloaded = await counter.count(slot, PAYLOAD, "one two three", after_load=True)
    assert (first, later, reloaded) == ((5, "tokenize"), (estimate("one two three"), "estimate"),
                                        (5, "tokenize"))
    estimated = [e for e in logs if e["event"] == "tokens.estimated"]
    assert [(e["log_level"], e["slot"], e["reason"], e["bound_s"]) for e in estimated] == [
        ("info", "llm", "timed out counting tokens", 0.1)]


async def test_a_tokenizer_that_hangs_makes_one_request_wait_the_first_counts_bound(
    upstream_app, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(tokens, "TOKENIZE_TIMEOUT_S", 0.1)
    monkeypatch.setattr(tokens, "FIRST_COUNT_TIMEOUT_S", 0.4)
    url = await upstream_app({"POST /tokenize": slow_tokenizer([30.0])})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    waited = []
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        with capture_logs() as logs:
            for _ in range(2):
                started = time.monotonic()
                assert await counter.count(slot, PAYLOAD, "a" * 40) == (10, "estimate")
                waited.append(time.monotonic() - started)
    assert 0.4 <= waited[0] < 0.8 and waited[1] < 0.3, waited
    assert [e["bound_s"] for e in logs if e["event"] == "tokens.estimated"] == [0.4, 0.1]


async def test_a_count_that_fails_at_once_is_logged_with_its_cause_and_stays_first(upstream_app):
    """A 503 while the model loads is quick: the next count still has the first count's time."""
    answers = [web.json_response({"error": "Loading model"}, status=503),
               web.json_response({"tokens": [1, 2, 3, 4, 5]})]

    async def tokenize(_: web.Request) -> web.Response:
        return answers.pop(0)

    url = await upstream_app({"POST /tokenize": tokenize})
    slot = SlotConfig(name="llm", upstream=url, models=("m",))
    async with aiohttp.ClientSession() as session:
        counter = TokenCounter(UpstreamClient(session))
        with capture_logs() as logs:
            assert await counter.count(slot, PAYLOAD, "a" * 40) == (10, "estimate")
            assert await counter.count(slot, PAYLOAD, "a" * 40) == (5, "tokenize")
    [estimated] = [e for e in logs if e["event"] == "tokens.estimated"]
    assert (estimated["log_level"], estimated["reason"]) == ("info", "/tokenize answered 503")
    assert estimated["bound_s"] == tokens.FIRST_COUNT_TIMEOUT_S
