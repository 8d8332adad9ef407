"""The conversations of the `warm` section (bench/warm.py), as its client holds them: a system
prompt of seeded notes and a short question a turn, each answer added to the next turn's prompt.
A turn is streamed to its end and read both as the client saw it (time to first token, usage)
and as llama-server did (its timings: the tokens it read, and those it took from its cache).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import orjson

from bench import client

NOTE_WORDS = 1220  # ~1,250 prompt tokens with the system prompt and the chat template
ANSWER_TOKENS = 24
WORDS = ("river", "stone", "light", "garden", "window", "morning", "paper", "music", "winter",
         "forest", "engine", "market", "silver", "letter", "harbor", "candle", "mountain",
         "bridge", "orchard", "lantern", "meadow", "copper", "valley", "thunder", "pocket",
         "island", "ribbon", "castle", "shadow", "feather")


@dataclass
class Turn:
    """One streamed turn as the client saw it; times in seconds from sending it."""

    request_id: str
    status: int = 0
    ttft_s: float | None = None  # the first token of the answer's text
    total_s: float = 0.0
    text: str = ""
    prompt_tokens: int | None = None  # usage: what the client is told
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    prompt_n: int | None = None  # timings: what the server read, and took from its cache
    cache_n: int | None = None
    error: str = ""
    row: dict[str, Any] = field(default_factory=dict)  # hal0d's history row of it

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and self.prompt_n is not None

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "ok": self.ok}


class Conversation:
    """A system prompt of seeded notes and a question a turn; each answer is added to it."""

    def __init__(self, name: str, seed: int) -> None:
        rng = random.Random(seed)
        notes = " ".join(rng.choice(WORDS) for _ in range(NOTE_WORDS))
        self.name = name
        self.rng = rng
        self.messages: list[dict[str, str]] = [
            {"role": "system", "content": f"You answer in one short sentence. Notes {name}: "
                                          + notes},
        ]
        self.turns: list[Turn] = []
        self.ask()

    def ask(self) -> None:
        word = self.rng.choice(WORDS)
        self.messages.append({"role": "user", "content": f"Question {len(self.turns) + 1}: "
                                                         f"where do the notes name the {word}?"})

    def body(self, model: str) -> bytes:
        return orjson.dumps({"model": model, "messages": self.messages, "stream": True,
                             "stream_options": {"include_usage": True},
                             "max_tokens": ANSWER_TOKENS, "temperature": 0})

    def answered(self, turn: Turn) -> None:
        self.turns.append(turn)
        self.messages.append({"role": "assistant", "content": turn.text or "I do not know."})
        self.ask()

    def ideal(self) -> int:
        """Every token of the conversation read once: the first turn's prompt, then each later
        turn's new tokens (its prompt beyond the last one's and the answer the server wrote
        into its cache as it generated it)."""
        total, held = 0, 0
        for t in self.turns:
            if t.prompt_tokens is None:
                continue  # a failed turn: the next one asks what it asked, and more
            total += max(0, t.prompt_tokens - held)
            held = t.prompt_tokens + (t.completion_tokens or 0)
        return total


def short_body(model: str) -> bytes:
    """The other model's request: a swap's cause, short, so its own prompt costs nothing."""
    return orjson.dumps({"model": model, "stream": True, "max_tokens": 4, "temperature": 0,
                         "stream_options": {"include_usage": True},
                         "messages": [{"role": "user", "content": "Say hello."}]})


async def stream_turn(session: aiohttp.ClientSession, base: str, body: bytes,
                      request_id: str) -> Turn:
    """The turn streamed to its end; its text, usage and llama-server's timings read from the
    events (hal0d relays them as the server sent them)."""
    turn = Turn(request_id)
    headers = {**client.JSON_HEADERS, "X-Request-Id": request_id}
    began = time.perf_counter()
    pending = b""
    try:
        async with session.post(base + client.CHAT, data=body, headers=headers) as resp:
            turn.status = resp.status
            if resp.status != 200:
                turn.error = f"status {resp.status}: {(await resp.read())[:200]!r}"
                return turn
            async for piece in resp.content.iter_any():
                pending += piece
                *lines, pending = pending.split(b"\n")
                for line in lines:
                    read_event(turn, line.rstrip(b"\r"), time.perf_counter() - began)
            read_event(turn, pending.rstrip(b"\r"), time.perf_counter() - began)
    except (aiohttp.ClientError, OSError) as exc:
        turn.error = type(exc).__name__
    turn.total_s = time.perf_counter() - began
    if not turn.error and turn.prompt_n is None:
        turn.error = "no timings in the stream"
    return turn


def read_event(turn: Turn, line: bytes, at_s: float) -> None:
    if not line.startswith(b"data:"):
        return  # blank lines, keepalive comments
    data = line[5:].strip()
    if data == b"[DONE]":
        return
    try:
        event = orjson.loads(data)
    except orjson.JSONDecodeError:
        turn.error = f"not JSON: {data[:80]!r}"
        return
    if "error" in event:
        turn.error = f"error event: {str(event['error'])[:120]}"
        return
    for choice in event.get("choices") or ():
        text = (choice.get("delta") or {}).get("content")
        if text:
            turn.text += text
            if turn.ttft_s is None:
                turn.ttft_s = at_s
    if usage := event.get("usage"):
        turn.prompt_tokens = usage.get("prompt_tokens")
        turn.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        turn.completion_tokens = usage.get("completion_tokens")
    if timings := event.get("timings"):
        turn.prompt_n, turn.cache_n = timings.get("prompt_n"), timings.get("cache_n")
    if turn.ttft_s is None and event.get("choices") == [] and turn.prompt_n is not None:
        turn.ttft_s = at_s  # an answer with no text at all: its end stands for its first token
