"""What the stall guard's tests share: the bounds of a [dispatcher] table (`guard`), a response as
the client received it, chunk by chunk with the time of each (`receive`), hal0d's stall frame read
back and checked (`stall_frame`, `assert_chat_frame`), and the slack a bound is given on a busy
machine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from hal0d.protocol.sse import Decoder
from tests.harness.poll import eventually

NOTICE = "\n\n[hal0] stall guard:"
TRIPPED = "dispatch.stream_stall_guard_tripped"
# Slack allowed after a bound: the "within 0.5 s after it".
SLACK = 0.5
# Loopback latency between hal0d receiving a chunk and the client receiving it.
EPSILON = 0.05


@dataclass
class Received:
    status: int
    headers: Any
    started: float
    ended: float
    chunks: list[tuple[float, bytes]]

    @property
    def raw(self) -> bytes:
        return b"".join(data for _, data in self.chunks)

    @property
    def duration(self) -> float:
        return self.ended - self.started

    def last_upstream_chunk_at(self) -> float:
        """When the client got the last chunk that is not hal0d's own frame."""
        return max(at for at, data in self.chunks if b"x_hal0_stall" not in data)


async def receive(
    http: aiohttp.ClientSession, url: Any, body: dict[str, Any]
) -> Received:
    started = time.monotonic()
    async with asyncio.timeout(5), http.post(url, json=body) as resp:  # a guard that never trips
        chunks: list[tuple[float, bytes]] = []
        async for data in resp.content.iter_any():
            chunks.append((time.monotonic(), data))
        ended = time.monotonic()
        return Received(resp.status, resp.headers, started, ended, chunks)


def sse_data(raw: bytes) -> list[str]:
    return [event.data for event in Decoder().feed(raw)]


def stall_frame(raw: bytes) -> dict[str, Any]:
    """The stream ends with hal0d's frame as its own event, then [DONE]; return the frame."""
    events = sse_data(raw)
    assert events[-1] == "[DONE]", events[-3:]
    frame: dict[str, Any] = orjson.loads(events[-2])
    assert frame["id"] == "hal0-stall-guard"
    return frame


def assert_chat_frame(frame: dict[str, Any], reason: str) -> None:
    assert frame["object"] == "chat.completion.chunk"
    [choice] = frame["choices"]
    assert choice["index"] == 0
    assert choice["delta"]["role"] == "assistant"
    assert choice["delta"]["content"].startswith(NOTICE)
    assert reason in choice["delta"]["content"]
    assert choice["finish_reason"] == "length"
    stall = frame["x_hal0_stall"]
    assert stall["reason"] == reason
    assert stall["upstream"] == "llm"
    assert isinstance(stall["elapsed_s"], float | int)


async def wait_for_stub_line(stub: Any, word: str, within: float) -> None:
    def logged() -> bool:
        assert any(word in line for line in stub.lines()), stub.lines()
        return True

    await eventually(logged, within, f"{word!r} in the stub's log")


def guard(total: float, idle: float, **more: float) -> dict[str, float]:
    return {"stream_total_timeout_s": total, "stream_idle_timeout_s": idle, **more}


def llm_slot(snapshot: dict[str, Any]) -> dict[str, Any]:
    [slot] = [s for s in snapshot["slots"] if s["name"] == "llm"]
    return slot
