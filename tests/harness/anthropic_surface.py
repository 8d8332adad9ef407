"""What the Anthropic Messages surface's tests share: the request's body, the stream's wire read
strictly (`check_wire`) and folded for comparison (`names`, `collapsed`, `without_ids`), the error
envelope of a refusal, and a purpose-built upstream that writes chat completion chunks as a script
says (`scripted`, `chunk`). The independent SSE client that reads the streams is
tests/harness/client.py's `read_independently`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs, web

from tests.anthropic_rules import Event, events_from_sse

MESSAGES = "/llm/v1/messages"


def body(model: str = "reasoning", *, stream: bool = True, content: str = "hi",
         max_tokens: int = 64, **extra: Any) -> dict[str, Any]:
    return {"model": model, "max_tokens": max_tokens, "stream": stream,
            "messages": [{"role": "user", "content": content}], **extra}


# --- reading streams -----------------------------------------------------------------------


def check_wire(raw: bytes) -> list[Event]:
    """Our strict reading of the bytes, plus what the wire itself must look like."""
    assert b"[DONE]" not in raw
    events = events_from_sse(raw)  # every frame is exactly an event: line and a data: line
    for frame in raw[:-2].split(b"\n\n"):
        data = frame.split(b"\n")[1][len(b"data: "):]
        compact = json.dumps(json.loads(data), separators=(",", ":"), ensure_ascii=False)
        assert data == compact.encode(), f"data is not compact JSON: {data!r}"
    return events


async def post_stream(
    http: aiohttp.ClientSession, url: Any, payload: dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.post(url, json=payload, headers=headers) as resp:
        return resp, await resp.read()


def names(events: list[Event]) -> list[str]:
    return [name for name, _ in events]


def collapsed(events: list[Event]) -> list[str]:
    """Event names with runs of content_block_delta folded into one `delta...` entry, and the
    block type and index on each content_block_start / content_block_stop."""
    out: list[str] = []
    for name, data in events:
        if name == "content_block_delta":
            if out[-1] != "delta...":
                out.append("delta...")
        elif name == "content_block_start":
            out.append(f"start {data['content_block']['type']} {data['index']}")
        elif name == "content_block_stop":
            out.append(f"stop {data['index']}")
        else:
            out.append(name)
    return out


def whole_prompt(usage: dict[str, Any]) -> dict[str, Any]:
    """A usage with its prompt as one count: the same request asked again reads the part of its
    prompt the upstream's cache holds from there (cache_read_input_tokens), not as input_tokens."""
    out = dict(usage)
    out["input_tokens"] += out.pop("cache_read_input_tokens", 0)
    return out


def without_ids(events: list[Event]) -> list[Event]:
    """The events without what differs between two asks of the same: the message's id, and how
    much of the prompt the upstream's cache held."""
    out = []
    for name, data in events:
        if name == "message_start":
            out.append((name, {**data, "message": {**data["message"], "id": "msg_"}}))
        elif name == "message_delta":
            out.append((name, {**data, "usage": whole_prompt(data["usage"])}))
        else:
            out.append((name, data))
    return out


async def error_body(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    assert resp.content_type == "application/json", resp.content_type
    parsed = await resp.json()
    assert set(parsed) == {"type", "error"} and parsed["type"] == "error", parsed
    assert set(parsed["error"]) >= {"type", "message"}, parsed
    return parsed["error"]


# --- upstreams -----------------------------------------------------------------------------


def chunk(delta: dict[str, Any] | None = None, finish: str | None = None,
          usage: dict[str, int] | None = None) -> bytes:
    payload: dict[str, Any] = {
        "id": "chatcmpl-test", "object": "chat.completion.chunk", "created": 1, "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}],
    }
    if usage is not None:
        payload["usage"] = usage
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def scripted(pieces: list[bytes | float], seen: list[dict[str, Any]] | None = None,
             ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """An upstream that writes `pieces` in order; a float is a pause of that many seconds.
    It ends the body cleanly after the last piece, whatever the pieces said."""

    async def handler(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(await request.json())
        response = web.StreamResponse(headers={hdrs.CONTENT_TYPE: "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            if isinstance(piece, float):
                await asyncio.sleep(piece)
            else:
                await response.write(piece)
        await response.write_eof()
        return response

    return handler


ROLE = chunk({"role": "assistant", "content": None})
COMPLETE = [ROLE, chunk({"content": "Hel"}), chunk({"content": "lo"}), chunk(finish="stop"),
            b"data: [DONE]\n\n"]
