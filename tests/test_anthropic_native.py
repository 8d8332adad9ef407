"""Native Anthropic slots: `[[slots]] anthropic = "native"` relays the Messages API raw to the
upstream's own /v1/messages, and "auto" asks the upstream once whether it has one.

Driven by the official anthropic SDK over real sockets, against the stub made with
`anthropic_native` (it serves /v1/messages itself, as llama-server does, and logs the
anthropic-version and anthropic-beta headers it received).
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from structlog.testing import capture_logs

from hal0d.appkeys import LIFECYCLE, RUNTIME
from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.forward.modes import AnthropicModes
from hal0d.lifecycle.reload import ConfigDiff
from hal0d.routing import Runtime
from hal0d.transport.upstream import UpstreamClient
from hal0d_stub.app import make_stub_app
from hal0d_stub.models import CONTENT_TEXT, REASONING_TEXT, words
from hal0d_stub.prompt import prompt_tokens
from tests.harness.client import state_is
from tests.harness.config import build_config
from tests.harness.daemons import start
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub, answering_first, serve_stub, stub_command

if TYPE_CHECKING:
    from anthropic import AsyncAnthropic

HI = [{"role": "user", "content": "hi"}]
TOOL = {"name": "lookup", "description": "Look something up.",
        "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
STALL_BOUNDS = {"stream_idle_timeout_s": 0.5, "stream_total_timeout_s": 30.0}


@pytest.fixture
async def native_stub(aiohttp_server: Any, tmp_path: Path) -> Stub:
    return await serve_stub(aiohttp_server, tmp_path, anthropic_native=True)


@pytest.fixture
async def hal0d(native_stub: Stub, start_hal0d: Any) -> TestServer:
    return await start_hal0d(native_stub.url, slot={"anthropic": "native"},
                             aliases={"claude-*": "chat"})


@pytest.fixture
async def guarded(native_stub: Stub, start_hal0d: Any) -> TestServer:
    """A short idle bound, for the stall case only: a loaded machine must not trip it on a
    healthy stream."""
    return await start_hal0d(native_stub.url, slot={"anthropic": "native"},
                             dispatcher=STALL_BOUNDS)


def sdk(server: TestServer) -> AsyncAnthropic:
    from anthropic import AsyncAnthropic

    return AsyncAnthropic(
        base_url=str(server.make_url("/llm")), api_key="x", max_retries=0, timeout=10.0,
        default_headers={"anthropic-version": "2023-06-01", "anthropic-beta": "tools-2024-05-16"},
    )


@pytest.fixture
async def client(hal0d: TestServer) -> AsyncIterator[AsyncAnthropic]:
    async with sdk(hal0d) as client:
        yield client


async def test_native_stream_reaches_the_upstreams_messages_with_the_clients_headers(
    client: AsyncAnthropic, native_stub: Stub
) -> None:
    async with client.messages.stream(model="reasoning", max_tokens=256, messages=HI) as stream:
        final = await stream.get_final_message()
    assert [block.type for block in final.content] == ["thinking", "text"]
    assert final.content[0].thinking == REASONING_TEXT  # type: ignore[union-attr]
    assert final.content[1].text == CONTENT_TEXT  # type: ignore[union-attr]
    seen = [line for line in native_stub.lines() if "native-messages" in line]
    assert seen and "anthropic-version=2023-06-01" in seen[-1]
    assert "anthropic-beta=tools-2024-05-16" in seen[-1]


async def test_native_whole_message_and_alias(client: AsyncAnthropic) -> None:
    message = await client.messages.create(model="claude-x", max_tokens=64, messages=HI)
    assert message.model == "chat"  # the upstream was asked for the alias's target
    assert message.content[0].text == CONTENT_TEXT  # type: ignore[union-attr]
    assert message.stop_reason == "end_turn"


async def test_native_tool_use_streamed_and_not(client: AsyncAnthropic) -> None:
    whole = await client.messages.create(model="tool", max_tokens=64, messages=HI, tools=[TOOL])
    async with client.messages.stream(model="tool", max_tokens=64, messages=HI,
                                      tools=[TOOL]) as stream:
        streamed = await stream.get_final_message()
    for message in (whole, streamed):
        assert message.stop_reason == "tool_use"
        assert message.content[0].type == "tool_use"
        assert message.content[0].input == {"query": "weather in Paris"}


async def test_native_count_tokens_is_the_upstreams(
    client: AsyncAnthropic, native_stub: Stub
) -> None:
    counted = await client.messages.count_tokens(model="chat", messages=HI)
    assert counted.input_tokens == prompt_tokens({"messages": HI})  # the stub's own count
    assert any("native-count-tokens" in line for line in native_stub.lines())


async def test_native_stream_bytes_equal_the_upstreams(
    upstream_app: Any, native_stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    request = {"model": "reasoning", "max_tokens": 256, "messages": HI, "stream": True}
    async with http.post(f"{native_stub.url}/v1/messages", json=request) as answer:
        recorded = await answer.read()

    async def replay(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for at in range(0, len(recorded), 61):
            await response.write(recorded[at:at + 61])
        return response

    upstream = await upstream_app({"POST /v1/messages": replay})
    hal0d = await start_hal0d(upstream, models=("reasoning",), slot={"anthropic": "native"})
    async with http.post(hal0d.make_url("/v1/messages"), json=request) as answer:
        through = await answer.read()
    assert through == recorded


async def test_native_stall_raises_a_clean_error_in_the_sdk(
    guarded: TestServer, native_stub: Stub
) -> None:
    from anthropic import APIStatusError

    async with sdk(guarded) as client:
        with pytest.raises(APIStatusError, match="stall guard"):
            async with client.messages.stream(model="stall", max_tokens=64,
                                              messages=HI) as stream:
                async for _ in stream:
                    pass
    assert any("stalling" in line for line in native_stub.lines())


async def test_native_break_raises_in_the_sdk(client: AsyncAnthropic) -> None:
    from anthropic import APIStatusError

    with pytest.raises(APIStatusError, match="broke the stream"):
        async with client.messages.stream(model="broken", max_tokens=64, messages=HI) as stream:
            async for _ in stream:
                pass


async def test_native_history_rows_carry_ttft_and_tokens(
    client: AsyncAnthropic, hal0d: TestServer, http: aiohttp.ClientSession
) -> None:
    async with client.messages.stream(model="chat", max_tokens=256, messages=HI) as stream:
        await stream.get_final_message()

    async def row() -> Any:
        async with http.get(hal0d.make_url("/api/requests?limit=1")) as answer:
            rows = (await answer.json())["requests"]
        assert rows and rows[0]["endpoint"] == "/llm/v1/messages", rows
        return rows[0]

    found = await eventually(row, 5.0, "the stream's history row")
    assert found["ok"] and found["ttft_ms"] is not None
    assert found["completion_tokens"] == len(words(CONTENT_TEXT))
    assert found["prompt_tokens"] == prompt_tokens({"messages": HI})


@pytest.mark.parametrize(("native", "expected"), [(True, "native"), (False, "translate")])
async def test_auto_asks_once_and_logs_its_choice(
    native: bool, expected: str, aiohttp_server: Any, tmp_path: Path, start_hal0d: Any
) -> None:
    log = tmp_path / "stub.log"
    stub = Stub(await aiohttp_server(make_stub_app(log, 0.002, anthropic_native=native)), log)
    hal0d = await start_hal0d(stub.url, slot={"anthropic": "auto"})
    request = {"model": "chat", "max_tokens": 64, "messages": HI}
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.post(hal0d.make_url("/v1/messages"), json=request) as answer:
                    assert answer.status == 200
                    assert (await answer.json())["content"][0]["text"] == CONTENT_TEXT
    chosen = [entry for entry in logs if entry["event"] == "anthropic.mode_chosen"]
    assert [(entry["slot"], entry["mode"]) for entry in chosen] == [("llm", expected)]
    relayed = [line for line in stub.lines() if "native-messages" in line]
    # Native: the probe and the three requests reached /v1/messages; translate: the stub without
    # the endpoint answered the probe 404 (no handler, no log line) and chat got the three.
    assert len(relayed) == (4 if native else 0)
    chats = [line for line in stub.lines() if line.split()[1:2] == ["start"]
             and "endpoint=chat" in line]
    assert len(chats) == (0 if native else 3)


def test_config_refuses_an_unknown_anthropic_mode(tmp_path: Path) -> None:
    from hal0d.config import ConfigError, load

    path = tmp_path / "hal0d.toml"
    path.write_text('[[slots]]\nname = "a"\nupstream = "http://127.0.0.1:1"\nmodels = ["m"]\n'
                    'anthropic = "passthrough"\n')
    with pytest.raises(ConfigError, match=r"slots\[0\]\.anthropic: 'passthrough' is not one of"):
        load(path)


async def test_native_slot_leaves_the_body_to_its_upstream_and_translate_checks_it(
    hal0d: TestServer, stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    # No max_tokens: the translator requires one; a native upstream may have its own default.
    body = {"model": "chat", "messages": HI}
    async with http.post(hal0d.make_url("/v1/messages"), json=body) as answer:
        assert answer.status == 200
        assert (await answer.json())["content"][0]["text"] == CONTENT_TEXT
    translating = await start_hal0d(stub.url)
    async with http.post(translating.make_url("/v1/messages"), json=body) as answer:
        assert answer.status == 400
        error = await answer.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in error["error"]["message"]


async def test_a_native_slot_holds_an_answer_to_its_max_output_tokens(
    native_stub: Stub, start_hal0d: Any
) -> None:
    """max_output_tokens clamps a Messages request's max_tokens on a native slot as on a
    translated one: the upstream is asked for at most that many, whole or streamed."""
    server = await start_hal0d(native_stub.url,
                               slot={"anthropic": "native", "max_output_tokens": 3})
    client = sdk(server)
    message = await client.messages.create(model="chat", max_tokens=256, messages=HI)
    assert (message.stop_reason, message.usage.output_tokens) == ("max_tokens", 3)
    async with client.messages.stream(model="chat", max_tokens=256, messages=HI) as stream:
        streamed = await stream.get_final_message()
    assert (streamed.stop_reason, streamed.usage.output_tokens) == ("max_tokens", 3)
    # A request under the limit goes through as sent.
    message = await client.messages.create(model="chat", max_tokens=2, messages=HI)
    assert message.usage.output_tokens == 2


# -- "auto": decided by a definite answer, kept for one process ------------------------------

async def messages(http: aiohttp.ClientSession, hal0d: TestServer) -> tuple[int, Any]:
    request = {"model": "chat", "max_tokens": 64, "messages": HI}
    async with http.post(hal0d.make_url("/v1/messages"), json=request) as answer:
        return answer.status, await answer.json()


def choices(logs: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(entry["mode"], entry["probe_status"]) for entry in logs
            if entry["event"] == "anthropic.mode_chosen"]


@pytest.mark.parametrize("first_status", [503, 429, 401])
@pytest.mark.parametrize("native", [True, False])
async def test_auto_is_not_decided_by_an_answer_that_says_nothing_of_the_endpoint(
    first_status: int, native: bool, aiohttp_server: Any, tmp_path: Path, start_hal0d: Any
) -> None:
    log = tmp_path / "stub.log"
    app = answering_first(first_status, make_stub_app(log, 0.002, anthropic_native=native),
                          "/v1/messages")
    stub = Stub(await aiohttp_server(app), log)
    hal0d = await start_hal0d(stub.url, slot={"anthropic": "auto"})
    with capture_logs() as logs:
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                status, answer = await messages(http, hal0d)
                assert status == 200, answer
                assert answer["content"][0]["text"] == CONTENT_TEXT
    undecided = [entry["probe_status"] for entry in logs
                 if entry["event"] == "anthropic.mode_undecided"]
    assert undecided == [first_status]
    # Asked again by the next request, and kept from then on.
    assert choices(logs) == [("native", 400) if native else ("translate", 404)]
    # Native: the first request translated, the second probe and two requests at /v1/messages.
    relayed = [line for line in stub.lines() if "native-messages" in line]
    chats = [line for line in stub.lines() if line.split()[1:2] == ["start"]
             and "endpoint=chat" in line]
    assert (len(relayed), len(chats)) == ((3, 1) if native else (0, 3))


async def test_auto_takes_a_500_for_the_empty_request_as_the_endpoint_there(
    aiohttp_server: Any, tmp_path: Path, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    """llama-server's answer to `{}` at /v1/messages: its handler raises for the missing
    `messages`, which it answers 500 "'messages' is required"."""
    log = tmp_path / "stub.log"
    app = make_stub_app(log, 0.002, anthropic_native=True)

    @web.middleware
    async def like_llama_server(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path == "/v1/messages" and await request.read() == b"{}":
            return web.json_response({"error": {"code": 500, "type": "server_error",
                                                "message": "'messages' is required"}},
                                     status=500)
        return await handler(request)

    app.middlewares.append(like_llama_server)
    stub = Stub(await aiohttp_server(app), log)
    hal0d = await start_hal0d(stub.url, slot={"anthropic": "auto"})
    with capture_logs() as logs:
        status, answer = await messages(http, hal0d)
    assert status == 200 and answer["content"][0]["text"] == CONTENT_TEXT, answer
    assert choices(logs) == [("native", 500)]


async def test_a_choice_is_kept_for_its_process_and_asked_again_for_the_next(
    upstream_app: Any
) -> None:
    has_endpoint, probes = [True], []

    async def endpoint(request: web.Request) -> web.StreamResponse:
        probes.append(await request.read())
        return web.json_response({}, status=400 if has_endpoint[0] else 404)

    url = await upstream_app({"POST /v1/messages": endpoint})
    slot = SlotConfig(name="llm", upstream=url, models=("chat",), anthropic="auto")
    modes, client = AnthropicModes(), UpstreamClient.create(DispatcherConfig())
    try:
        assert await modes.mode(client, slot, 1) == "native"
        has_endpoint[0] = False  # the slot's next process has no /v1/messages
        assert await modes.mode(client, slot, 1) == "native"  # the same process: not asked
        assert await modes.mode(client, slot, 2) == "translate"
        assert await modes.mode(client, slot, 2) == "translate"
    finally:
        await client.close()
    assert probes == [b"{}", b"{}"]


def native_then_not(name: str, tmp_path: Path) -> tuple[str, tuple[str, ...]]:
    """(upstream, command): the stub with /v1/messages the first time, without it after."""
    port = free_port()
    log = tmp_path / f"{name}.log"
    marker = shlex.quote(str(tmp_path / f"{name}.started"))
    native = " ".join(shlex.quote(arg) for arg in stub_command(port, log, "--anthropic-native"))
    plain = " ".join(shlex.quote(arg) for arg in stub_command(port, log))
    script = f"if [ -e {marker} ]; then exec {plain}; fi; : > {marker}; exec {native}"
    return f"http://127.0.0.1:{port}", ("sh", "-c", script)


async def test_a_reload_that_changes_only_the_command_asks_again(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    port = free_port()
    log = tmp_path / "llm.log"
    before = SlotConfig(name="llm", upstream=f"http://127.0.0.1:{port}", models=("chat",),
                        command=stub_command(port, log, "--anthropic-native"),
                        anthropic="auto")
    hal0d = await start(start_hal0d, build_config(tmp_path, before))
    await state_is(http, hal0d, "llm", "ready")
    with capture_logs() as logs:
        assert (await messages(http, hal0d))[0] == 200
        # The same upstream, a command whose server has no /v1/messages.
        after = build_config(tmp_path, dataclasses.replace(before,
                                                               command=stub_command(port, log)))
        lifecycle = hal0d.app[LIFECYCLE]
        await lifecycle.apply(ConfigDiff.between(lifecycle.configs, after.slots, after.groups))
        hal0d.app[RUNTIME].current = Runtime.build(after)
        await state_is(http, hal0d, "llm", "ready")
        status, answer = await messages(http, hal0d)
    assert status == 200 and answer["content"][0]["text"] == CONTENT_TEXT, answer
    assert choices(logs) == [("native", 400), ("translate", 404)]


async def test_a_restarted_process_is_asked_again(
    start_hal0d: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    upstream, command = native_then_not("llm", tmp_path)
    config = SlotConfig(name="llm", upstream=upstream, models=("chat",), command=command,
                        anthropic="auto")
    hal0d = await start(start_hal0d, build_config(tmp_path, config))
    await state_is(http, hal0d, "llm", "ready")
    runner = hal0d.app[LIFECYCLE].runners["llm"]
    with capture_logs() as logs:
        assert (await messages(http, hal0d))[0] == 200
        assert runner.child is not None
        os.kill(runner.child.pid, signal.SIGKILL)
        await state_is(http, hal0d, "llm", "error", 5)
        await state_is(http, hal0d, "llm", "ready")
        status, answer = await messages(http, hal0d)
    assert status == 200, answer
    assert choices(logs) == [("native", 400), ("translate", 404)]
