"""Scoped keys ([[keys]]) over real sockets: what each scope reaches, a key's model globs on every
surface (an alias is no way past them), and its limits (429 with Retry-After). Every refusal is
also shown to reach nothing: the stub's request log has no line for it. A key's name in what
hal0d records, and a reload that adds a key, are tested in test_keys_named.py; check-config's
refusals and the secrets' sources in test_keys_config.py."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import aiohttp

from hal0d.config import KeyConfig
from tests.harness.client import Stream, chat_body, open_stream
from tests.harness.config import make_config
from tests.harness.daemons import OllamaFactory, ServerFactory
from tests.harness.keys import (
    ADMIN_KEY,
    INFERENCE_KEY,
    ONE_AT_A_TIME_KEY,
    PER_MINUTE_KEY,
    READ_KEY,
    bearer,
    call,
    chat,
    start_keyed,
)
from tests.harness.stubs import Stub, StubFactory


async def test_an_inference_key_limited_by_globs_gets_its_models_and_nothing_else(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                   body=chat("plain"))
    assert status == 200, answer
    reached = len(stub.lines())
    assert reached >= 1

    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                   body=chat("r1"))
    assert status == 403, answer
    assert answer["error"]["code"] == "access.forbidden"
    assert "'laptop'" in answer["error"]["message"] and "'r1'" in answer["error"]["message"]
    # The served name is no way around the glob either.
    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                   body=chat("reasoning"))
    assert status == 403, answer
    status, answer, _ = await call(http, hal0d, "POST", "/llm/v1/messages", INFERENCE_KEY, body={
        "model": "r1", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]})
    assert (status, answer["error"]["type"]) == (403, "permission_error"), answer

    for path in ("/api/requests", "/api/timeline"):
        status, answer, _ = await call(http, hal0d, "GET", path, INFERENCE_KEY)
        assert status == 403, answer
        assert "'laptop' may not read" in answer["error"]["message"]
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/llm/unload", INFERENCE_KEY)
    assert status == 403, answer
    assert len(stub.lines()) == reached, stub.lines()[reached:]  # none of them reached it

    status, answer, _ = await call(http, hal0d, "GET", "/v1/models", INFERENCE_KEY)
    assert status == 200
    # Only the served models its globs name (aliases are not listed models).
    assert [model["id"] for model in answer["data"]] == ["chat"]
    status, answer, _ = await call(http, hal0d, "GET", "/v1/models", ONE_AT_A_TIME_KEY)
    assert {model["id"] for model in answer["data"]} == {"chat", "tool", "reasoning", "think-only"}


async def test_a_read_key_reads_but_neither_calls_models_nor_unloads_and_an_admin_key_does(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    for path in ("/api/requests", "/api/slots", "/api/status", "/api/slots/metrics",
                 "/api/timeline"):
        status, answer, _ = await call(http, hal0d, "GET", path, READ_KEY)
        assert status == 200, (path, answer)
    async with http.get(hal0d.make_url("/")) as resp:
        assert resp.status == 200 and "<html" in (await resp.text()).lower()
    async with http.get(hal0d.make_url("/api/events"), headers=bearer(READ_KEY)) as resp:
        assert resp.status == 200
        assert resp.content_type == "text/event-stream"

    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", READ_KEY,
                                   body=chat("chat"))
    assert status == 403, answer
    assert "'dashboard' may not call models" in answer["error"]["message"]
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/llm/unload", READ_KEY)
    assert status == 403, answer
    assert "'dashboard' may not load or unload" in answer["error"]["message"]
    assert stub.lines() == []

    # The admin key gets past the scope check to the slot itself: this slot has no command, so
    # hal0d says it cannot unload what it did not start (the lifecycle's own refusal, 409).
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/llm/unload", ADMIN_KEY)
    assert status == 409, answer
    assert answer["error"]["code"] == "slot.conflict"
    # A slot it does start and stop: the admin key loads it and unloads it; the read key
    # cannot unload it meanwhile.
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/ondemand/load", ADMIN_KEY)
    assert (status, answer["state"]) == (200, "ready"), answer
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/ondemand/unload", READ_KEY)
    assert status == 403, answer
    status, answer, _ = await call(http, hal0d, "POST", "/api/slots/ondemand/unload", ADMIN_KEY)
    assert (status, answer["state"]) == (200, "stopped"), answer


async def test_a_key_at_max_concurrent_gets_429_with_retry_after_until_its_request_ends(
    start_stub: StubFactory, start_hal0d: ServerFactory, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    stub = await start_stub(delay=0.02)
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    running = Stream("the key's one request")
    task = asyncio.create_task(open_stream(http, str(hal0d.make_url("")).rstrip("/"), running,
                                           chat_body("chat", max_tokens=60),
                                           headers=bearer(ONE_AT_A_TIME_KEY)))
    await running.first_chunk.wait()
    reached = len(stub.lines())
    status, answer, headers = await call(http, hal0d, "POST", "/v1/chat/completions",
                                         ONE_AT_A_TIME_KEY, body=chat("chat"))
    assert status == 429, answer
    assert answer["error"]["code"] == "access.key_limited"
    assert "'agent'" in answer["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert len(stub.lines()) == reached
    # Another key is not held back by this one's limit.
    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                   body=chat("plain"))
    assert status == 200, answer
    await task
    assert running.finished_normally(), running.data[-2:]
    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions",
                                   ONE_AT_A_TIME_KEY, body=chat("chat"))
    assert status == 200, answer


async def test_a_key_past_requests_per_minute_gets_429_with_the_wait_in_retry_after(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    for _ in range(2):
        status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions",
                                       PER_MINUTE_KEY, body=chat("chat"))
        assert status == 200, answer
    reached = len(stub.lines())
    status, answer, headers = await call(http, hal0d, "POST", "/v1/chat/completions",
                                         PER_MINUTE_KEY, body=chat("chat"))
    assert status == 429, answer
    assert "requests_per_minute" in answer["error"]["message"]
    assert 55 <= int(headers["Retry-After"]) <= 60
    assert len(stub.lines()) == reached
    # The model list is no model call: it is not counted.
    status, _, _ = await call(http, hal0d, "GET", "/v1/models", PER_MINUTE_KEY)
    assert status == 200


async def test_a_glob_alias_is_no_way_past_a_keys_globs_on_any_surface(
    start_ollama: OllamaFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A key scoped to `chat*` beside the alias `"*" = "reasoning"`: `chat-please` matches the
    key's glob as typed, but is served by `reasoning`, which the key may not use. The scope is
    the served model's on every surface, and nothing reaches the upstream."""
    config = dataclasses.replace(
        make_config(stub.url, tmp_path=tmp_path, aliases={"*": "reasoning"}),
        keys=(KeyConfig(name="scoped", scopes=("inference",), key=INFERENCE_KEY,
                        secret=INFERENCE_KEY, models=("chat*",)),))
    hal0d, ollama = await start_ollama(stub.url, config=config)
    hi = [{"role": "user", "content": "hi"}]
    refused = [
        (str(hal0d.make_url("/v1/chat/completions")), chat("chat-please")),
        (str(hal0d.make_url("/v1/messages")),
         {"model": "chat-please", "max_tokens": 8, "messages": hi}),
        (str(hal0d.make_url("/v1/messages/count_tokens")),
         {"model": "chat-please", "messages": hi}),
        (str(hal0d.make_url("/v1/responses")), {"model": "chat-please", "input": "hi"}),
        (f"{ollama}/api/chat", {"model": "chat-please", "messages": hi, "stream": False}),
        (f"{ollama}/api/generate", {"model": "chat-please", "prompt": "hi", "stream": False}),
        (f"{ollama}/api/show", {"model": "chat-please"}),
    ]
    for url, body in refused:
        async with http.post(url, json=body, headers=bearer(INFERENCE_KEY)) as resp:
            answer = await resp.json()
            assert resp.status == 403, (url, answer)
            message = answer["error"] if isinstance(answer["error"], str) else (
                answer["error"]["message"])
            assert "'scoped'" in message and "'reasoning'" in message, (url, message)
    assert stub.lines() == []  # none of them reached the upstream
    # The key's own model, under its own name, is served.
    status, answer, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                   body=chat("chat"))
    assert status == 200, answer


async def test_an_unknown_model_answered_to_a_scoped_key_lists_only_the_models_it_may_use(
    start_ollama: OllamaFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = dataclasses.replace(make_config(stub.url, tmp_path=tmp_path), keys=(
        KeyConfig(name="scoped", scopes=("inference",), key=INFERENCE_KEY,
                  secret=INFERENCE_KEY, models=("chat*", "tool")),))
    hal0d, ollama = await start_ollama(stub.url, config=config)
    for url in (str(hal0d.make_url("/v1/chat/completions")), f"{ollama}/api/chat"):
        async with http.post(url, json=chat("nope"), headers=bearer(INFERENCE_KEY)) as resp:
            answer = await resp.json()
        assert resp.status == 404, answer
        message = answer["error"] if isinstance(answer["error"], str) else (
            answer["error"]["message"])
        assert message.endswith("served models: chat, chatty, tool"), message
