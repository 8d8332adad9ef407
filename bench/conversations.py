"""Closed-loop conversations against any OpenAI-compatible chat endpoint, as an agent holds them.

A conversation opens with a system prompt of seeded notes (random words: a long first prompt the
server must read once), then asks a short question a turn; each answer is appended to the
history, so every turn's prompt is the last one's plus a few tokens. A server that keeps the
conversation in its KV cache reads only those few; one that lost it reads the whole history
again. Each turn is a non-streamed chat completion, and the server's own count of what it read
(llama-server's `timings.prompt_n`, which hal0d passes through) is kept beside the usage.

`closed_loop` runs conversations side by side for a wall time: each sends its next turn as soon
as its last one is answered (or failed), none after the window, and the turns still in flight
at its end are awaited (up to DRAIN_S), so a slow last turn is measured, not dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import aiohttp
import orjson

from bench import client

WORDS = ("river", "stone", "light", "garden", "window", "morning", "paper", "music", "winter",
         "forest", "engine", "market", "silver", "letter", "harbor", "candle", "mountain",
         "bridge", "orchard", "lantern", "meadow", "copper", "valley", "thunder", "pocket",
         "island", "ribbon", "castle", "shadow", "feather")
ANSWER_TOKENS = 12
TURN_TIMEOUT_S = 300.0  # a turn not answered by then is an error, not a hang of the bench
DRAIN_S = 120.0  # the most the turns in flight at the window's end are waited for
# A conversation whose history nears its server slot's context starts over with new notes (as
# an agent's would): without it a fast system's conversation overflows its slot and fails.
CONTEXT_MARGIN = 256


@dataclass
class Turn:
    """One turn as the client saw it; times in seconds from the window's start."""

    conversation: str
    model: str
    began_s: float
    ended_s: float = 0.0
    status: int = 0
    error: str = ""
    prompt_n: int | None = None  # timings: what the server read
    cache_n: int | None = None  # and what it took from its cache
    prompt_tokens: int | None = None  # usage: the whole prompt
    completion_tokens: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def latency_s(self) -> float:
        return self.ended_s - self.began_s

    @property
    def full_prompt(self) -> int | None:
        """The whole prompt of the turn: read plus cached, or what usage says."""
        if self.prompt_n is not None and self.cache_n is not None:
            return self.prompt_n + self.cache_n
        return self.prompt_tokens


@dataclass
class Conversation:
    """Seeded notes as the system prompt, then a question a turn; each answer is kept."""

    name: str
    model: str
    seed: int
    note_words: int
    context: int  # the server slot's context, in tokens
    turns: list[Turn] = field(default_factory=list)
    in_flight: Turn | None = None  # sent, not answered yet
    # The last answered full prompt of the history under way, and of each one it started over
    # from: every history's earlier prompts and answers are a prefix of its last prompt.
    last_prompt: int = 0
    finished_prompts: list[int] = field(default_factory=list)
    # What a server that never lost the conversation must read: each turn's prompt beyond the
    # last one's and its answer (which the server wrote into its cache as it generated it).
    least_read: int = 0
    held: int = 0  # of the history under way: the last prompt and its answer
    messages: list[dict[str, str]] = field(default_factory=list)
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.start_over()

    def start_over(self) -> None:
        if self.last_prompt:
            self.finished_prompts.append(self.last_prompt)
        self.last_prompt = self.held = 0
        notes = " ".join(self.rng.choice(WORDS) for _ in range(self.note_words))
        self.messages = [{"role": "system", "content": f"You answer in one short sentence. "
                                                       f"Notes {self.name}: {notes}"}]

    def body(self) -> bytes:
        asked = sum(1 for m in self.messages if m["role"] == "user")
        question = {"role": "user", "content": f"Question {asked + 1}: where do the notes name "
                                               f"the {self.rng.choice(WORDS)}?"}
        self.messages.append(question)
        return orjson.dumps({"model": self.model, "messages": self.messages, "stream": False,
                             "max_tokens": ANSWER_TOKENS, "temperature": 0})

    def answered(self, turn: Turn, answer: str | None) -> None:
        """The turn kept; its answer appended (a failed turn's question is asked again)."""
        self.turns.append(turn)
        self.in_flight = None
        if not turn.ok:
            self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": answer or "I do not know."})
        full = turn.full_prompt
        if full is None:
            return
        self.last_prompt = full
        self.least_read += max(0, full - self.held)
        self.held = full + (turn.completion_tokens or 0)
        if full + (turn.completion_tokens or 0) > self.context - CONTEXT_MARGIN:
            self.start_over()

    def ideal(self) -> int:
        """Every prompt token read once: the last answered full prompt of each history (its
        answers counted as if read, which a server that keeps its cache does not: least_read)."""
        return sum(self.finished_prompts) + self.last_prompt


async def take_turn(session: aiohttp.ClientSession, base: str, talk: Conversation,
                    began: float) -> None:
    turn = talk.in_flight = Turn(talk.name, talk.model, time.monotonic() - began)
    answer = None
    try:
        async with session.post(base + client.CHAT, data=talk.body(), headers=client.JSON_HEADERS,
                                timeout=aiohttp.ClientTimeout(total=TURN_TIMEOUT_S)) as resp:
            turn.status = resp.status
            raw = await resp.read()
        if turn.status != 200:
            turn.error = f"status {turn.status}: {raw[:160]!r}"
        else:
            answer = read_answer(turn, orjson.loads(raw))
    except (aiohttp.ClientError, OSError, TimeoutError, orjson.JSONDecodeError) as exc:
        turn.error = f"{type(exc).__name__}: {exc}"[:200]
    turn.ended_s = time.monotonic() - began
    talk.answered(turn, answer)


def read_answer(turn: Turn, answer: dict[str, object]) -> str | None:
    """The answer's text; its usage and the server's timings noted on the turn."""
    usage = answer.get("usage")
    if isinstance(usage, dict):
        turn.prompt_tokens = usage.get("prompt_tokens")
        turn.completion_tokens = usage.get("completion_tokens")
    timings = answer.get("timings")
    if isinstance(timings, dict):
        turn.prompt_n, turn.cache_n = timings.get("prompt_n"), timings.get("cache_n")
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices:
        turn.error = "no choices in the answer"
        return None
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    return message.get("content") if isinstance(message, dict) else None


async def closed_loop(base: str, talks: list[Conversation], seconds: float) -> float:
    """Every conversation a turn after the other for `seconds`; returns the wall time until the
    last turn in flight ended. A turn still unanswered DRAIN_S after the window is cancelled and
    stays in its conversation's `in_flight`."""
    began = time.monotonic()

    async def converse(talk: Conversation) -> None:
        while time.monotonic() - began < seconds:
            await take_turn(session, base, talk, began)

    async with client.session() as session:
        tasks = [asyncio.create_task(converse(t)) for t in talks]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*tasks), seconds + DRAIN_S)
    return time.monotonic() - began
