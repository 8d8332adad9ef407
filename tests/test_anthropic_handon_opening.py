"""A route hands a streamed Messages request on to a native slot after a keepalive already sent
the client hal0d's own message_start: the client still reads one message.

The route is [a (translated), b (native)] with keepalive on: a takes 3 s, then answers 503, so
the client has had hal0d's message_start and pings when b's stream begins with its own
message_start. Driven by the anthropic SDK's streaming client over real sockets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import httpx2
import orjson
from aiohttp import web

from hal0d.anthropic import native
from hal0d.anthropic.stream import encode_events
from hal0d.config import DispatcherConfig, RouteConfig, SlotConfig
from tests.harness.client import Recording
from tests.harness.config import build_config
from tests.harness.daemons import ServerFactory

KEEPALIVE_S = 0.3
REFUSES_AFTER_S = 3.0
INPUT_TOKENS, CACHED_TOKENS = 4321, 17  # the native upstream's own count: no estimate says it
TEXT = ("Hello", " from", " b.")


def native_events() -> bytes:
    """A native upstream's stream, as llama-server sends it: usage in message_start, only
    output_tokens in message_delta."""
    message = {"id": "msg_b", "type": "message", "role": "assistant", "model": "chat",
               "content": [], "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": INPUT_TOKENS, "cache_read_input_tokens": CACHED_TOKENS,
                         "output_tokens": 0}}
    events: list[tuple[str, dict[str, Any]]] = [
        ("message_start", {"type": "message_start", "message": message}),
        ("content_block_start", {"type": "content_block_start", "index": 0,
                                 "content_block": {"type": "text", "text": ""}}),
        *[("content_block_delta", {"type": "content_block_delta", "index": 0,
                                   "delta": {"type": "text_delta", "text": piece}})
          for piece in TEXT],
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                           "usage": {"output_tokens": len(TEXT)}}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return encode_events(events)


async def refusing_late(_: web.Request) -> web.Response:
    await asyncio.sleep(REFUSES_AFTER_S)
    return web.json_response({"error": {"message": "busy", "type": "unavailable"}}, status=503)


async def native_stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    recorded = native_events()
    for at in range(0, len(recorded), 37):  # reads that cut events, message_start's too
        await response.write(recorded[at:at + 37])
    return response


async def test_a_native_slot_after_a_keepalives_opening_sends_no_second_message_start(
    start_hal0d: ServerFactory, upstream_app: Any, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    slow = await upstream_app({"POST /v1/chat/completions": refusing_late})
    answering = await upstream_app({"POST /v1/messages": native_stream})
    slots = (SlotConfig(name="a", upstream=slow, models=("a-only",), anthropic="translate"),
             SlotConfig(name="b", upstream=answering, models=("b-only",), anthropic="native"))
    route = RouteConfig(model="claude-route", slots=("a", "b"), served={"a": "chat", "b": "chat"})
    hal0d = await start_hal0d("http://unused", config=build_config(
        tmp_path, *slots, routes=(route,), dispatcher=DispatcherConfig(keepalive_s=KEEPALIVE_S)))
    recording = Recording()
    client = anthropic.AsyncAnthropic(base_url=str(hal0d.make_url("")), api_key="x",
                                      max_retries=0, timeout=30.0,
                                      http_client=httpx2.AsyncClient(transport=recording))
    async with client.messages.stream(model="claude-route", max_tokens=64,
                                      messages=[{"role": "user", "content": "hi"}]) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    body = recording.received()
    assert body.count(b"event: message_start") == 1, body.decode()
    assert body.count(b"event: ping") >= 2, body.decode()  # the wait was kept alive
    assert kinds.count("message_start") == 1, kinds
    assert final.content[0].text == "".join(TEXT)  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn"
    assert final.usage.input_tokens == INPUT_TOKENS  # the upstream's count, not the estimate
    assert final.usage.cache_read_input_tokens == CACHED_TOKENS
    assert final.usage.output_tokens == len(TEXT)
    async with http.get(hal0d.make_url("/api/requests?limit=1")) as resp:
        [row] = (await resp.json())["requests"]
    assert (row["slot"], row["failover"]) == ("b", "a=status_503")


def test_the_first_event_is_found_across_any_split_and_the_rest_passes_as_it_came() -> None:
    recorded = native_events()
    first_end = recorded.index(b"\n\n") + 2
    start = orjson.loads(recorded[:first_end].split(b"data: ", 1)[1])
    for cut in range(1, len(recorded)):
        transform = native.NativeAfterOpening()
        out = transform.feed(b": ping\n\n" + recorded[:cut]) + transform.feed(recorded[cut:])
        out += transform.end()
        head, _, rest = out.partition(b"\n\n")
        assert head == b": ping", (cut, out[:80])
        delta, _, after = rest.partition(b"\n\n")
        assert delta.startswith(b"event: message_delta\ndata: "), (cut, delta)
        usage = orjson.loads(delta.split(b"data: ", 1)[1])["usage"]
        assert usage["input_tokens"] == start["message"]["usage"]["input_tokens"]
        assert after == recorded[first_end:], cut
