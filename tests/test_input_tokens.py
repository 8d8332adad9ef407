"""Anthropic's input_tokens, over real sockets: counted on the prompt the upstream's model really
reads (its chat template applied), equal to the upstream's own usage.prompt_tokens and to
/v1/messages/count_tokens; and where hal0d can only estimate, the upstream's own usage wins.
Also the stub's `--anthropic-native` flag, run as a slot's real command."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from structlog.testing import capture_logs

from hal0d.config import Config, MetricsConfig, SlotConfig
from hal0d.transport.tokens import estimate
from hal0d_stub.prompt import SYSTEM_PREAMBLE
from tests.anthropic_rules import assert_valid_anthropic_stream, events_from_sse
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import Stub

MESSAGES = "/v1/messages"
WEATHER = {"name": "get_weather", "description": "The weather in a city, now.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


async def stream_events(
    http: aiohttp.ClientSession, url: Any, request: dict[str, Any]
) -> list[tuple[str, dict[str, Any]]]:
    async with http.post(url, json={**request, "stream": True}) as resp:
        assert resp.status == 200, await resp.text()
        events = events_from_sse(await resp.read())
    assert assert_valid_anthropic_stream(events) == "success"
    return events


async def test_message_start_input_tokens_equal_the_upstreams_own_prompt_tokens_and_count_tokens(
    stub: Stub, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d(stub.url)
    asks = [
        {"model": "chat", "max_tokens": 64,
         "messages": [{"role": "user", "content": "How many tokens is this?"}]},
        {"model": "tool", "max_tokens": 64, "system": "Be terse.", "tools": [WEATHER],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Paris?"}]},
                      {"role": "assistant", "content": "Let me look."},
                      {"role": "user", "content": "Go on."}]},
    ]
    for ask in asks:
        events = await stream_events(http, hal0d.make_url(MESSAGES), ask)
        counted_at_start = events[0][1]["message"]["usage"]["input_tokens"]
        delta = next(payload for name, payload in events if name == "message_delta")
        # message_delta carries the stub's own usage.prompt_tokens for the request it generated,
        # split as Anthropic does: the tokens the model read and those its prompt cache held.
        usage = delta["usage"]
        said = usage["input_tokens"] + usage.get("cache_read_input_tokens", 0)
        assert counted_at_start == said, ask
        async with http.post(hal0d.make_url(f"{MESSAGES}/count_tokens"), json={
            key: value for key, value in ask.items() if key != "max_tokens"
        }) as resp:
            assert resp.status == 200
            assert resp.headers["X-Hal0d-Token-Count"] == "template"
            assert (await resp.json())["input_tokens"] == counted_at_start
    # The first ask has no system prompt: the template's preamble is counted, not the 6 words.
    first = await stream_events(http, hal0d.make_url(MESSAGES), asks[0])
    assert first[0][1]["message"]["usage"]["input_tokens"] > len(SYSTEM_PREAMBLE.split()) + 5


def usage_only_at_the_end(prompt_tokens: int) -> Any:
    """A llama-cpp-python-like upstream: no /apply-template, no tokenizer hal0d can reach, and
    its usage (counting its own template) in the last chunk."""

    async def chat(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for choice in ({"index": 0, "delta": {"role": "assistant", "content": "Hi"},
                        "finish_reason": None},
                       {"index": 0, "delta": {}, "finish_reason": "stop"}):
            chunk = {"id": "c", "object": "chat.completion.chunk", "choices": [choice]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                 "total_tokens": prompt_tokens + 1}
        last = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": usage}
        await response.write(b"data: " + orjson.dumps(last) + b"\n\ndata: [DONE]\n\n")
        return response

    return chat


async def test_without_a_template_the_upstreams_usage_wins_in_message_delta_and_history(
    upstream_app: Any, start_hal0d: Any, http: aiohttp.ClientSession
) -> None:
    url = await upstream_app({"POST /v1/chat/completions": usage_only_at_the_end(36)})
    hal0d = await start_hal0d(url, models=("chat",))
    text = "Say hi."
    events = await stream_events(http, hal0d.make_url(MESSAGES), {
        "model": "chat", "max_tokens": 16, "messages": [{"role": "user", "content": text}]})
    assert events[0][1]["message"]["usage"]["input_tokens"] == estimate(text)  # chars / 4
    delta = next(payload for name, payload in events if name == "message_delta")
    assert delta["usage"] == {"input_tokens": 36, "output_tokens": 1}

    async def row() -> Any:
        async with http.get(hal0d.make_url("/api/requests?limit=1")) as answer:
            rows = (await answer.json())["requests"]
        assert rows and rows[0]["endpoint"] == MESSAGES, rows
        return rows[0]

    assert (await eventually(row, 5.0, "the stream's history row"))["prompt_tokens"] == 36


async def test_a_slot_running_the_stub_with_anthropic_native_is_chosen_native_by_auto(
    start_hal0d: Any, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    chosen: dict[str, str] = {}
    for flags in ((), ("--anthropic-native",)):
        port, log = free_port(), tmp_path / f"stub{len(flags)}.log"
        command = (sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--log", str(log),
                   "--delay", "0.002", *flags)
        slot = SlotConfig(name="llm", upstream=f"http://127.0.0.1:{port}", models=("chat",),
                          command=command, start="on_demand", anthropic="auto")
        config = Config(slots=(slot,), base_dir=tmp_path, metrics=MetricsConfig(
            database=str(tmp_path / f"history{len(flags)}.sqlite3")))
        hal0d = await start_hal0d("http://unused", config=config)
        with capture_logs() as logs:
            async with http.post(hal0d.make_url(MESSAGES), json={
                "model": "chat", "max_tokens": 16,
                "messages": [{"role": "user", "content": "hi"}]}) as resp:
                assert resp.status == 200, await resp.text()
        [entry] = [e for e in logs if e["event"] == "anthropic.mode_chosen"]
        chosen[" ".join(flags)] = entry["mode"]
        served_natively = any("native-messages" in line for line in log.read_text().splitlines())
        assert served_natively == bool(flags)
    assert chosen == {"": "translate", "--anthropic-native": "native"}
