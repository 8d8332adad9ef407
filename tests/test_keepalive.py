"""Keepalive while a streamed request waits (forward/keepalive.py), over real sockets and real
clients: a load of a few seconds, or a queue, or a silent first slot, against a client whose
read timeout is shorter than the wait. Each client completes with the whole answer, its first
byte within keepalive_s + 1 s; a failure after the head ends the stream in the surface's error
frame (the SDK raises); a route hands on after keepalives with no trace of its first slot.

The scale is the issue's (a load of 30 s, a read timeout of 10 s, keepalive_s 10) divided down:
a load of ~2.5 s, a read timeout of 1 s, keepalive_s 0.3: the same orders, a suite that stays
quick."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx
import httpx2
import ollama
import openai
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from hal0d.appkeys import SLOTS
from hal0d.config import Config, DispatcherConfig, RouteConfig, SlotConfig
from hal0d.lifecycle.slots import SlotState
from tests.harness.client import Recording, chat_body
from tests.harness.config import build_config, on_demand
from tests.harness.daemons import STARTUP_S, OllamaFactory, ServerFactory
from tests.harness.poll import eventually
from tests.harness.processes import stub_pids
from tests.harness.stubs import Stub

KEEPALIVE_S = 0.3
READ_TIMEOUT_S = 1.0
LOAD_DELAY = "2"  # the stub's --startup-delay: with its own start, a load of ~2.5 s


def config(tmp_path: Path, *slots: SlotConfig, routes: tuple[RouteConfig, ...] = ()) -> Config:
    return build_config(tmp_path, *slots, routes=routes,
                        dispatcher=DispatcherConfig(keepalive_s=KEEPALIVE_S))


async def slow_loading(start_hal0d: ServerFactory, tmp_path: Path, *extra: str) -> TestServer:
    slot = on_demand("a", tmp_path, "--startup-delay", LOAD_DELAY, *extra)
    return await start_hal0d("http://unused", config=config(tmp_path, slot))


def sdk(hal0d: TestServer, recording: Recording | None = None) -> openai.AsyncOpenAI:
    """The openai SDK with a read timeout shorter than a load; `recording`: what it reads."""
    return openai.AsyncOpenAI(base_url=str(hal0d.make_url("/v1")), api_key="unused",
                              max_retries=0,
                              timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0),
                              http_client=httpx2.AsyncClient(transport=recording)
                              if recording is not None else None)


async def test_without_keepalive_the_short_read_timeout_gives_up_during_the_load(
    start_hal0d: ServerFactory, tmp_path: Path
) -> None:
    """What the keepalive is for: with keepalive_s 0 the same client times out while the
    model loads."""
    slot = on_demand("a", tmp_path, "--startup-delay", LOAD_DELAY)
    plain = build_config(tmp_path, slot, dispatcher=DispatcherConfig(keepalive_s=0.0))
    hal0d = await start_hal0d("http://unused", config=plain)
    with pytest.raises(openai.APITimeoutError):
        stream = await sdk(hal0d).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass


async def test_an_openai_sdk_stream_through_a_load_completes_and_its_first_byte_is_early(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await slow_loading(start_hal0d, tmp_path)
    stream = await sdk(hal0d).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                    if chunk.choices])
    assert text.startswith("Hello!"), text
    # A second request after an unload: its first byte, and what the comments say.
    await unload(http, hal0d, "a")
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat")) as resp:
        first = await resp.content.readany()
        first_at = time.monotonic() - started
        rest = await resp.read()
    assert resp.status == 200 and resp.content_type == "text/event-stream"
    assert first_at < KEEPALIVE_S + 1.0, first_at
    body = first + rest
    assert body.startswith(b": hal0d: loading chat, "), body[:80]
    assert body.rstrip().endswith(b"data: [DONE]"), body[-80:]


async def unload(http: aiohttp.ClientSession, hal0d: TestServer, name: str) -> None:
    async with http.post(hal0d.make_url(f"/api/slots/{name}/unload")) as resp:
        assert resp.status == 200, await resp.text()
    await eventually(lambda: hal0d.app[SLOTS][name].state is SlotState.STOPPED, STARTUP_S,
                     f"{name} unloaded")


async def test_a_responses_stream_through_a_load_completes(
    start_hal0d: ServerFactory, tmp_path: Path
) -> None:
    hal0d = await slow_loading(start_hal0d, tmp_path)
    async with sdk(hal0d).responses.stream(model="chat", input="hi") as stream:
        final = await stream.get_final_response()
    assert final.output_text.startswith("Hello!"), final.output_text


async def test_a_load_that_fails_after_the_head_ends_the_stream_in_an_error_the_sdk_raises(
    start_hal0d: ServerFactory, tmp_path: Path
) -> None:
    hal0d = await slow_loading(start_hal0d, tmp_path, "--fail-start", "out of memory")
    with pytest.raises(openai.APIError) as raised:
        stream = await sdk(hal0d).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass
    assert "out of memory" in str(raised.value), raised.value


async def test_a_load_goes_on_when_its_only_client_left_and_serves_the_next_request(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await slow_loading(start_hal0d, tmp_path)
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat")) as resp:
        assert (await resp.content.readany()).startswith(b": hal0d: loading")
    # The client left during the load: the load goes on, and the next request takes it.
    await eventually(lambda: hal0d.app[SLOTS]["a"].state is SlotState.READY, STARTUP_S,
                     "the load the client left finished")
    pids = stub_pids(str(tmp_path))
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat", stream=False)) as resp:
        assert resp.status == 200, await resp.text()
    assert stub_pids(str(tmp_path)) == pids and len(pids) == 1


async def test_a_route_hands_on_after_keepalives_and_the_client_gets_the_second_answer(
    start_hal0d: ServerFactory, stub: Stub, upstream_app: Any, tmp_path: Path,
    http: aiohttp.ClientSession
) -> None:
    async def silent(_: web.Request) -> web.Response:  # answers its probe, never a request
        await asyncio.sleep(60)
        return web.Response()

    quiet = await upstream_app({"POST /v1/chat/completions": silent})
    slots = (SlotConfig(name="one", upstream=quiet, models=("one-only",)),
             SlotConfig(name="two", upstream=stub.url, models=("two-only",)))
    route = RouteConfig(model="qwen", slots=("one", "two"),
                        served={"one": "chat", "two": "chat"}, first_byte_timeout_s=1.2)
    hal0d = await start_hal0d("http://unused", config=config(tmp_path, *slots, routes=(route,)))
    # What the client read: keepalives while the first slot sat silent, then the second slot's
    # answer alone (the stub's), nothing of the first.
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("qwen")) as resp:
        body = await resp.read()
    head, _, answer = body.partition(b"data: ")
    assert head.startswith(b": hal0d: ") and head.count(b": hal0d: ") >= 2, body[:200]
    assert b"Hello!" in answer and answer.rstrip().endswith(b"data: [DONE]")
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        [row] = (await resp.json())["requests"]
    assert (row["slot"], row["failover"]) == ("two", "one=first_byte_timeout")
    # The SDK reads the same (the silent slot now cools down: the second answers at once).
    stream = await sdk(hal0d).chat.completions.create(
        model="qwen", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                    if chunk.choices])
    assert text.startswith("Hello!"), text


async def test_a_request_queued_behind_a_busy_slot_is_kept_alive_and_says_so(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slot = SlotConfig(name="llm", upstream=stub.url, models=("chatty", "chat"),
                      max_concurrent=1)
    hal0d = await start_hal0d(stub.url, config=config(tmp_path, slot))

    async def endless() -> None:  # chatty never finishes: the slot stays busy until it leaves
        async with http.post(hal0d.make_url("/v1/chat/completions"),
                             json=chat_body("chatty")) as resp:
            await resp.read()

    busy = asyncio.create_task(endless())
    await eventually(lambda: hal0d.app[SLOTS]["llm"].in_flight == 1, 5.0, "the slot busy")
    started = time.monotonic()
    async with http.post(hal0d.make_url("/v1/chat/completions"),
                         json=chat_body("chat")) as resp:
        first = await resp.content.readany()
        first_at = time.monotonic() - started
        busy.cancel()  # the first client leaves: the queued request gets the slot
        body = first + await resp.read()
    assert first_at < KEEPALIVE_S + 1.0, first_at
    assert body.startswith(b": hal0d: queued for llm, 0 ahead (interactive)"), body[:80]
    assert b"Hello!" in body and body.rstrip().endswith(b"data: [DONE]")
    async with http.get(hal0d.make_url("/metrics")) as resp:
        metrics = await resp.text()
    counted = [line for line in metrics.splitlines()
               if line.startswith('hal0d_keepalives_total{surface="openai"}')]
    assert counted and float(counted[0].split()[-1]) == body.count(b": hal0d: "), counted


async def test_an_anthropic_sdk_stream_through_a_load_gets_message_start_then_pings(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """Strict order: message_start with the head, pings while the model loads, then the
    content blocks and message_stop; the SDK reads the answer whole."""
    hal0d = await slow_loading(start_hal0d, tmp_path)
    client = anthropic.AsyncAnthropic(base_url=str(hal0d.make_url("/llm")), api_key="unused",
                                      max_retries=0, timeout=READ_TIMEOUT_S)
    async with client.messages.stream(model="chat", max_tokens=64,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        message = await stream.get_final_message()
    assert message.content[0].type == "text" and message.content[0].text.startswith("Hello!")
    await unload(http, hal0d, "a")
    async with http.post(hal0d.make_url("/llm/v1/messages"), json={
            "model": "chat", "max_tokens": 64, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}) as resp:
        events = [line.split(b": ", 1)[1].decode() for line in (await resp.read()).split(b"\n")
                  if line.startswith(b"event: ")]
    pings = events.count("ping")
    assert events[0] == "message_start" and pings >= 2, events
    assert events[1:1 + pings] == ["ping"] * pings, events
    assert events[1 + pings] == "content_block_start" and events[-1] == "message_stop", events


async def test_an_ollama_client_stream_through_a_load_completes(
    start_ollama: OllamaFactory, tmp_path: Path
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", LOAD_DELAY)
    _, base = await start_ollama("http://unused", config=config(tmp_path, slot))
    client = ollama.AsyncClient(host=base, timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0))
    pieces = [part async for part in await client.chat(
        "chat", [{"role": "user", "content": "hi"}], stream=True)]
    assert "".join(part.message.content or "" for part in pieces).startswith("Hello!")
    assert pieces[0].message.content == "" and not pieces[0].done  # a keepalive came first
    assert pieces[-1].done


async def test_a_failed_load_after_the_head_raises_in_the_anthropic_and_ollama_clients(
    start_ollama: OllamaFactory, tmp_path: Path
) -> None:
    slot = on_demand("a", tmp_path, "--startup-delay", LOAD_DELAY, "--fail-start", "no memory")
    hal0d, base = await start_ollama("http://unused", config=config(tmp_path, slot))
    client = anthropic.AsyncAnthropic(base_url=str(hal0d.make_url("/llm")), api_key="unused",
                                      max_retries=0, timeout=READ_TIMEOUT_S)
    with pytest.raises(anthropic.APIStatusError) as raised:
        async with client.messages.stream(model="chat", max_tokens=64,
                                          messages=[{"role": "user", "content": "hi"}]) as s:
            await s.get_final_message()
    assert "no memory" in str(raised.value), raised.value
    with pytest.raises(ollama.ResponseError) as failed:
        async for _ in await ollama.AsyncClient(
                host=base, timeout=httpx.Timeout(READ_TIMEOUT_S, connect=5.0)).chat(
                "chat", [{"role": "user", "content": "hi"}], stream=True):
            pass
    assert "no memory" in str(failed.value), failed.value


async def test_an_upstream_silent_before_its_first_token_is_kept_alive_in_the_relays_stream(
    start_hal0d: ServerFactory, upstream_app: Any, tmp_path: Path
) -> None:
    """The upstream answers its head at once and then says nothing while it prefills (vLLM
    sends no comment lines): the keepalive goes on in the relay's own stream until the first
    chunk, and the openai SDK with a short read timeout reads the whole answer."""
    async def prefill_then_answer(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(2.5)
        for piece in ("Hello", " there"):
            await response.write(b"data: " + orjson.dumps({
                "id": "c", "object": "chat.completion.chunk", "model": "chat",
                "choices": [{"index": 0, "delta": {"content": piece},
                             "finish_reason": None}]}) + b"\n\n")
        await response.write(b"data: " + orjson.dumps({
            "id": "c", "object": "chat.completion.chunk", "model": "chat",
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    upstream = await upstream_app({"POST /v1/chat/completions": prefill_then_answer})
    slot = SlotConfig(name="llm", upstream=upstream, models=("chat",))
    hal0d = await start_hal0d(upstream, config=config(tmp_path, slot))
    stream = await sdk(hal0d).chat.completions.create(
        model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
    text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream
                    if chunk.choices])
    assert text == "Hello there"


async def test_a_queue_a_forced_unload_clears_after_the_head_ends_in_an_error_the_sdk_raises(
    start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await slow_loading(start_hal0d, tmp_path)
    recording = Recording()

    async def streamed() -> None:
        stream = await sdk(hal0d, recording).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass

    waiting = asyncio.create_task(streamed())
    # Its head and keepalives are out: three of the comments, read by the client under the
    # SDK's parser (which skips them), while the load goes on.
    await eventually(lambda: recording.received().count(b": hal0d: ") >= 3, STARTUP_S,
                     "three keepalives read by the client")
    assert hal0d.app[SLOTS]["a"].state is SlotState.STARTING
    assert not waiting.done()
    async with http.post(hal0d.make_url("/api/slots/a/unload?force=true")) as resp:
        assert resp.status == 200, await resp.text()
    with pytest.raises(openai.APIError) as raised:
        await waiting
    # An error event in the stream (the head was out), not a status.
    assert not isinstance(raised.value, openai.APIStatusError), raised.value
    assert "unloaded" in str(raised.value), raised.value


async def test_an_upstream_that_breaks_after_the_head_ends_in_an_error_the_sdk_raises(
    start_hal0d: ServerFactory, upstream_app: Any, tmp_path: Path
) -> None:
    """The upstream takes the request, says nothing while keepalives go out, then drops the
    connection before its head: the client's stream ends in the error event, not cut."""
    async def drops(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(1.0)
        assert request.transport is not None
        request.transport.abort()
        return web.Response()

    upstream = await upstream_app({"POST /v1/chat/completions": drops})
    slot = SlotConfig(name="llm", upstream=upstream, models=("chat",))
    hal0d = await start_hal0d(upstream, config=config(tmp_path, slot))
    with pytest.raises(openai.APIError) as raised:
        stream = await sdk(hal0d).chat.completions.create(
            model="chat", messages=[{"role": "user", "content": "hi"}], stream=True)
        async for _ in stream:
            pass
    assert not isinstance(raised.value, openai.APIStatusError), raised.value
    assert "llm" in str(raised.value), raised.value
