"""Scoped keys ([[keys]]) over real sockets: what each scope reaches, model globs, a key's limits
(429 with Retry-After), its name in the history, the request.done line, the event feed and
/metrics, a reload that adds a key without touching a loaded slot, and check-config's refusals.
Every refusal is also shown to reach nothing: the stub's request log has no line for it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import sys
import textwrap
import tomllib
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestServer

from hal0d.config import ConfigError, KeyConfig, parse
from tests.harness.client import Stream, chat_body, open_stream
from tests.harness.config import make_config
from tests.harness.daemons import Hal0dProcess, OllamaFactory, ServerFactory, launch, stop
from tests.harness.ports import free_port
from tests.harness.processes import stub_pids
from tests.harness.stubs import Stub, StubFactory, stub_command

INFERENCE_KEY = "hal0-inference-key-Vw3kq"
READ_KEY = "hal0-read-key-Lm8zr"
ADMIN_KEY = "hal0-admin-key-Qp2dx"
ONE_AT_A_TIME_KEY = "hal0-single-key-Hy6tn"
PER_MINUTE_KEY = "hal0-minute-key-Bc4ws"
SECRETS = (INFERENCE_KEY, READ_KEY, ADMIN_KEY, ONE_AT_A_TIME_KEY, PER_MINUTE_KEY)

KEYS_TOML = f"""
[[keys]]
name = "laptop"
key = "{INFERENCE_KEY}"
scopes = ["inference"]
models = ["chat*"]

[[keys]]
name = "dashboard"
key = "{READ_KEY}"
scopes = ["read"]

[[keys]]
name = "operator"
key = "{ADMIN_KEY}"
scopes = ["admin", "read"]

[[keys]]
name = "agent"
key = "{ONE_AT_A_TIME_KEY}"
scopes = ["inference"]
max_concurrent = 1

[[keys]]
name = "script"
key = "{PER_MINUTE_KEY}"
scopes = ["inference"]
requests_per_minute = 2
"""


def keyed_config_text(upstream: str, tmp_path: Path) -> str:
    # The aliases are other names of the stub's own models: a key's globs name the served model
    # an alias resolves to; `ondemand` is a slot hal0d starts and stops itself (what an admin
    # key loads and unloads).
    port = free_port()
    command = orjson.dumps(list(stub_command(port, tmp_path / "ondemand.log"))).decode()
    return f"""
[models]
plain = "chat"
plain-large = "tool"
r1 = "reasoning"

[[slots]]
name = "llm"
upstream = "{upstream}"
models = ["chat", "tool", "reasoning"]

[[slots]]
name = "ondemand"
upstream = "http://127.0.0.1:{port}"
models = ["think-only"]
command = {command}
start = "on_demand"

[metrics]
database = "{tmp_path / 'history.sqlite3'}"
""" + KEYS_TOML


async def start_keyed(start_hal0d: ServerFactory, stub: Stub, tmp_path: Path) -> TestServer:
    config = parse(tomllib.loads(keyed_config_text(stub.url, tmp_path)), base_dir=tmp_path)
    return await start_hal0d(stub.url, config=config)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def call(http: aiohttp.ClientSession, hal0d: TestServer, method: str, path: str,
               key: str, *, body: Any = None) -> tuple[int, Any, Any]:
    data = None if body is None else orjson.dumps(body)
    async with http.request(method, hal0d.make_url(path), data=data,
                            headers=bearer(key)) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json(), resp.headers
        return resp.status, await resp.text(), resp.headers


def chat(model: str) -> dict[str, Any]:
    return chat_body(model, stream=False)


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


async def test_a_keyed_request_names_its_key_in_history_metrics_and_event_feed(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    async with http.get(hal0d.make_url("/api/events"), headers=bearer(READ_KEY)) as feed:
        status, _, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                  body=chat("plain"))
        assert status == 200
        status, _, _ = await call(http, hal0d, "POST", "/v1/chat/completions",
                                  ONE_AT_A_TIME_KEY, body=chat("chat"))
        assert status == 200

        async def request_events() -> list[dict[str, Any]]:
            seen: list[dict[str, Any]] = []
            name = None
            async for line in feed.content:
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                elif line.startswith(b"data:") and name == b"request":
                    seen.append(json.loads(line[5:]))
                    if len(seen) == 2:
                        return seen
            return seen

        events = await asyncio.wait_for(request_events(), 5)
    assert [event["key"] for event in events] == ["laptop", "agent"], events

    status, answer, _ = await call(http, hal0d, "GET", "/api/requests", READ_KEY)
    assert [row["key"] for row in answer["requests"]][:2] == ["agent", "laptop"]
    status, answer, _ = await call(http, hal0d, "GET", "/api/requests?key=laptop", READ_KEY)
    assert [(row["key"], row["model"]) for row in answer["requests"]] == [("laptop", "plain")]
    status, text, _ = await call(http, hal0d, "GET", "/metrics", READ_KEY)
    assert 'key="laptop"' in text and 'key="agent"' in text
    assert not any(secret in text for secret in SECRETS)


@pytest.fixture
async def keyed_process(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Hal0dProcess]]]:
    """A real `hal0d serve` (a SIGHUP reload needs one), stopped after the test."""
    started: list[Hal0dProcess] = []

    async def start(upstream: str, **options: Any) -> Hal0dProcess:
        started.append(await launch(tmp_path, upstream, **options))
        return started[-1]

    yield start
    for hal0d in started:
        await stop(hal0d.process)


async def test_a_sighup_that_adds_a_key_lets_it_in_while_the_loaded_slot_keeps_its_process(
    stub: Stub, keyed_process: Callable[..., Awaitable[Hal0dProcess]], http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    port = free_port()
    command = ["hal0d", "stub", "--port", str(port), "--log", str(tmp_path / "slot.log")]
    slot = f"""
        [[slots]]
        name = "proc"
        upstream = "http://127.0.0.1:{port}"
        models = ["chat"]
        command = {orjson.dumps(command).decode()}
        start = "on_demand"
    """
    first = textwrap.dedent(f"""
        [[keys]]
        name = "laptop"
        key = "{INFERENCE_KEY}"
        scopes = ["inference", "read"]
    """)
    hal0d = await keyed_process(stub.url, slot=slot, extra=first)
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(INFERENCE_KEY)) as resp:
        assert resp.status == 200, await resp.text()
    [pid] = stub_pids(str(tmp_path))
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(ADMIN_KEY)) as resp:
        assert resp.status == 401

    added = textwrap.dedent("""
        [[keys]]
        name = "phone"
        key_file = "phone.key"
        scopes = ["inference"]
    """)
    (hal0d.config.parent / "phone.key").write_text(f"{ADMIN_KEY}\n")
    hal0d.config.write_text(hal0d.config.read_text() + added)
    hal0d.send(signal.SIGHUP)
    reloaded = await hal0d.wait_for_event("config.reloaded")
    assert reloaded["slots_changed"] == [] and reloaded["keys"] == 2, reloaded
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(ADMIN_KEY)) as resp:
        assert resp.status == 200, await resp.text()
    assert stub_pids(str(tmp_path)) == {pid}
    async with http.get(f"{hal0d.url}/api/slots", headers=bearer(INFERENCE_KEY)) as resp:
        [view] = (await resp.json())["slots"]
    assert (view["state"], view["pid"]) == ("ready", pid)

    done = [event for event in hal0d.named("request.done")
            if event.get("path") == "/v1/chat/completions"]
    assert [event.get("key") for event in done] == ["laptop", None, "phone"], done
    # The command line finds a key with `read` in the config (laptop's) and filters by name.
    listed = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "requests", "--config", str(hal0d.config),
        "--key", "phone", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await listed.communicate()
    assert listed.returncode == 0, err.decode()
    [header, row] = out.decode().splitlines()
    assert header.split()[:4] == ["TIME", "REQUEST", "KEY", "SLOT"]
    assert row.split()[2:5] == ["phone", "proc", "chat"], row
    log = hal0d.log.read_text()
    for secret in (INFERENCE_KEY, ADMIN_KEY):
        assert secret not in log


def refusals(text: str, tmp_path: Path) -> list[str]:
    with pytest.raises(ConfigError) as refused:
        parse(tomllib.loads(textwrap.dedent(text)), base_dir=tmp_path)
    return refused.value.problems


def test_check_config_refuses_a_key_without_scope_two_keys_of_one_name_and_an_empty_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty.key").write_text("\n")
    monkeypatch.setenv("HAL0D_TEST_EMPTY_KEY", "")
    problems = refusals("""
        [[keys]]
        name = "a"
        key = "secret-of-a-123"

        [[keys]]
        name = "b"
        key = "secret-of-b-456"
        scopes = []

        [[keys]]
        name = "a"
        key = "secret-of-a2-789"
        scopes = ["read"]

        [[keys]]
        name = "c"
        key = "  "
        scopes = ["read"]

        [[keys]]
        name = "d"
        key_file = "empty.key"
        scopes = ["read"]

        [[keys]]
        name = "e"
        key_env = "HAL0D_TEST_EMPTY_KEY"
        scopes = ["read"]

        [[keys]]
        name = "f"
        scopes = ["write"]
        key = "secret-of-a-123"
        key_env = "HOME"
    """, tmp_path)
    assert problems == [
        'keys[0].scopes: is required (any of inference, read, admin) (key "a")',
        "keys[1].scopes: [] must list at least one of inference, read, admin (key \"b\")",
        "keys[2].name: 'a' is used by another key (key \"a\")",
        'keys[3].key: the secret is empty (key "c")',
        'keys[4].key_file: the secret is empty (key "d")',
        "keys[5].key_env: the environment variable 'HAL0D_TEST_EMPTY_KEY' is unset or empty "
        '(key "e")',
        "keys[6].scopes: 'write' is not a scope (scopes: inference, read, admin) (key \"f\")",
        'keys[6]: needs exactly one of key, key_env, key_file (has key, key_env) (key "f")',
    ], problems
    for problem in problems:
        assert "secret-of" not in problem


def test_a_key_whose_secret_another_key_has_is_refused_without_showing_it(
    tmp_path: Path,
) -> None:
    problems = refusals("""
        [server]
        api_keys = ["shared-secret-0042"]

        [[keys]]
        name = "mine"
        key = "shared-secret-0042"
        scopes = ["read"]
    """, tmp_path)
    assert problems == ["keys[0]: its secret is also server.api_keys's; every key needs its "
                        'own (key "mine")']


def test_key_env_and_key_file_read_their_secrets_and_print_config_hides_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hal0d.config import to_toml

    monkeypatch.setenv("HAL0D_TEST_KEY", " from-the-environment-77 ")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(tmp_path / "credentials"))
    (tmp_path / "credentials").mkdir()
    (tmp_path / "credentials" / "phone").write_text("from-a-credential-88\n")
    config = parse(tomllib.loads(textwrap.dedent("""
        [[keys]]
        name = "laptop"
        key_env = "HAL0D_TEST_KEY"
        scopes = ["inference"]
        models = ["plain*", "qwen-?b"]
        max_concurrent = 2

        [[keys]]
        name = "phone"
        key_file = "${CREDENTIALS_DIRECTORY}/phone"
        scopes = ["read", "read", "inference"]
    """)), base_dir=tmp_path)
    laptop, phone = config.keys
    assert (laptop.secret, laptop.models, laptop.max_concurrent) == (
        "from-the-environment-77", ("plain*", "qwen-?b"), 2)
    assert (phone.secret, phone.scopes) == ("from-a-credential-88", ("read", "inference"))
    printed = to_toml(config)
    assert "from-the-environment-77" not in printed and "from-a-credential-88" not in printed
    again = parse(tomllib.loads(printed), base_dir=tmp_path)
    assert again.keys == config.keys


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
