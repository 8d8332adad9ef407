"""llama-server's keepalives while it reads a long prompt reach each translated surface's client,
over real sockets: a purpose-built upstream replays the capture
(tests/fixtures/llama-server/stream-prefill-pings: its head, then a `:` comment line a second
apart, then the answer) on a faster clock, behind hal0d, driven by the official SDKs.

The anthropic and openai SDKs skip pings and comment lines, which is the point; what they read
is recorded under them by an httpx transport (`Recording`), each read with its arrival time.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest
from aiohttp import web

from tests.harness.client import Recording
from tests.llama_server_capture import (
    PREFILL_COMPLETION_TOKENS,
    PREFILL_PINGS,
    PREFILL_PROMPT_TOKENS,
    PREFILL_TEXT,
    read_capture,
)

CAPTURE = read_capture(PREFILL_PINGS)
PINGS = CAPTURE.comment_chunks
SCALE = 0.2  # the capture's seconds on the replay's clock: its 1 s pings come every 0.2 s
# The replay's silence between the first comment and the first chunk (0.87 s), less a margin
# for a shared machine: a client that got the pings only with the answer did not get them.
PREFILL_S = (CAPTURE.times[PINGS] - CAPTURE.times[0]) * SCALE
UpstreamApp = Callable[[dict[str, Callable[[web.Request], Awaitable[web.StreamResponse]]]],
                       Awaitable[str]]


async def replay_prefill(request: web.Request) -> web.StreamResponse:
    """The capture's answer, each chunk written when the capture got it (on SCALE's clock)."""
    await request.read()
    response = web.StreamResponse(status=CAPTURE.status, headers=CAPTURE.headers)
    await response.prepare(request)
    started = time.monotonic()
    for at, chunk in zip(CAPTURE.times, CAPTURE.chunks, strict=True):
        await asyncio.sleep(max(0.0, started + at * SCALE - time.monotonic()))
        await response.write(chunk)
    await response.write_eof()
    return response


def name_of(frame: bytes) -> str:
    """A frame's event name, or `:` for a comment line."""
    first = frame.split(b"\n", 1)[0]
    if first.startswith(b":"):
        return ":"
    assert first.startswith(b"event: "), frame
    return first.removeprefix(b"event: ").decode()


@pytest.fixture
async def upstream(upstream_app: UpstreamApp) -> str:
    return await upstream_app({"POST /v1/chat/completions": replay_prefill})


async def test_the_anthropic_sdk_stream_gets_a_ping_per_upstream_comment_as_it_comes(
    upstream: str, start_hal0d: Any
) -> None:
    from anthropic import AsyncAnthropic

    hal0d = await start_hal0d(upstream, models=("chat",))
    recording = Recording()
    async with AsyncAnthropic(
        base_url=str(hal0d.make_url("/llm")), api_key="x", max_retries=0, timeout=10.0,
        http_client=httpx2.AsyncClient(transport=recording),
    ) as client, client.messages.stream(
        model="chat", max_tokens=64, messages=[{"role": "user", "content": "a long prompt"}]
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_message()
    assert final.content[0].text == PREFILL_TEXT  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens"
    # The upstream's prompt count, from message_delta, whatever message_start said.
    assert (final.usage.input_tokens, final.usage.output_tokens) == (
        PREFILL_PROMPT_TOKENS, PREFILL_COMPLETION_TOKENS)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"

    frames = recording.frames()
    names = [name_of(frame) for _, frame in frames]
    assert names == ["message_start", *["ping"] * PINGS, "content_block_start",
                     *["content_block_delta"] * PREFILL_COMPLETION_TOKENS,
                     "content_block_stop", "message_delta", "message_stop"], names
    assert all(frame == b'event: ping\ndata: {"type":"ping"}'
               for _, frame in frames if name_of(frame) == "ping")
    pinged = [at for at, frame in frames if name_of(frame) == "ping"]
    first_text = next(at for at, frame in frames if name_of(frame) == "content_block_start")
    assert first_text - pinged[0] >= PREFILL_S * 0.6, (pinged, first_text)
    assert all(b - a >= 0.1 for a, b in itertools.pairwise(pinged)), pinged


async def test_the_openai_sdk_responses_stream_through_the_bridge_gets_the_comments_in_order(
    upstream: str, start_hal0d: Any
) -> None:
    from openai import AsyncOpenAI

    hal0d = await start_hal0d(upstream, models=("chat",), slot={"responses": "translate"})
    recording = Recording()
    async with AsyncOpenAI(
        base_url=str(hal0d.make_url("/v1")), api_key="x", max_retries=0, timeout=10.0,
        http_client=httpx2.AsyncClient(transport=recording),
    ) as client, client.responses.stream(model="chat", input="a long prompt") as stream:
        events = [event async for event in stream]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == PREFILL_TEXT
    last = events[-1]
    assert last.type == "response.incomplete"  # finish_reason length, as the API says it
    assert last.response.usage is not None
    assert last.response.usage.input_tokens == PREFILL_PROMPT_TOKENS
    assert [e.sequence_number for e in events] == list(range(len(events)))

    frames = recording.frames()
    names = [name_of(frame) for _, frame in frames]
    assert names[:PINGS + 1] == [*[":"] * PINGS, "response.created"], names
    assert ":" not in names[PINGS:]
    assert [frame for _, frame in frames[:PINGS]] == [b": ping"] * PINGS
    first_item = next(at for at, frame in frames if name_of(frame) == "response.created")
    assert first_item - frames[0][0] >= PREFILL_S * 0.6, frames[:PINGS + 1]


async def test_the_ollama_client_chat_stream_gets_an_empty_piece_per_upstream_comment(
    upstream: str, start_ollama: Any
) -> None:
    from ollama import AsyncClient

    _, base = await start_ollama(upstream, models=("chat",))
    started = time.monotonic()
    parts = []
    async for part in await AsyncClient(host=base).chat(
        model="chat", messages=[{"role": "user", "content": "a long prompt"}], stream=True
    ):
        parts.append((time.monotonic() - started, part))
    pieces = [part.message.content for _, part in parts]
    assert pieces[:PINGS] == [""] * PINGS
    assert not any(part.done for _, part in parts[:PINGS])
    assert "".join(piece or "" for piece in pieces) == PREFILL_TEXT
    last = parts[-1][1]
    assert (last.done, last.done_reason, last.prompt_eval_count) == (
        True, "length", PREFILL_PROMPT_TOKENS)
    first_text = next(at for at, part in parts if part.message.content)
    assert first_text - parts[0][0] >= PREFILL_S * 0.6, [at for at, _ in parts]
