"""Conversations: which one a request continues, and which slot holds it warm.

An agent's conversation grows turn by turn and every turn sends the whole of it again; the model
server keeps what it has read (its prompt cache), so a turn that reaches the slot that served the
last one reads only the new tokens, and one sent elsewhere reads everything again. A request's
conversation key is the one its client gives (OpenAI's `prompt_cache_key`, which Codex sends; a
session header; Claude Code's `metadata.user_id`, which carries its session), else a digest of
what stays the same from turn to turn: the model, the system prompt or instructions, the tools,
the first user message.

Every key is its client's (`of_client`): the name of the API key the request came with, else the
client identity the queue knows it by (the body's OpenAI `user` or Anthropic `metadata.user_id`,
else the one anonymous client). Two users who both open with "hi" hold two conversations, and a
session id sent by another client names another conversation, not theirs.

`Affinity` remembers the slot that last served each conversation (a bounded LRU with a time to
live), so a route's plan can put it first (forward/path.py, Dispatch.order); the lifecycle forgets
a slot's conversations when its process stops without saving its caches, and hands back those a
restored cache holds again (lifecycle/prompt_cache.py).
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any, Final

import orjson

# The headers a client names its session with (the first one present counts).
SESSION_HEADERS: Final = ("x-session-id", "session_id", "x-claude-code-session-id")
# How much of a bare prompt string (legacy completions, Ollama's generate) is its stable prefix.
PROMPT_PREFIX_CHARS: Final = 4096
AFFINITY_SIZE: Final = 4096
AFFINITY_TTL_S: Final = 6 * 3600.0
# How many of a slot's conversations a saved cache names (the most recent first).
SAVED_CONVERSATIONS: Final = 64


def _digest(model: str, *parts: Any) -> str:
    text = orjson.dumps([model, *parts], option=orjson.OPT_SORT_KEYS, default=str)
    return hashlib.sha256(text).hexdigest()[:24]


def _given(headers: Mapping[str, str], model: str, given: Any) -> str | None:
    if isinstance(given, str) and given:
        return _digest(model, "given", given)
    for name in SESSION_HEADERS:
        if value := headers.get(name):
            return _digest(model, "given", value)
    return None


def of_client(client: str, conversation: str | None) -> str | None:
    """`conversation` as `client`'s own (client_of names the client): keys as the clients
    give them would let one client's turns move another's warm slot."""
    if conversation is None:
        return None
    return hashlib.sha256(f"{client}\n{conversation}".encode()).hexdigest()[:24]


def _first_user(messages: Any) -> Any:
    if isinstance(messages, str):
        return messages[:PROMPT_PREFIX_CHARS]
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            return message.get("content")
    return None


def _system(messages: Any) -> list[Any]:
    if not isinstance(messages, list):
        return []
    return [message.get("content") for message in messages
            if isinstance(message, dict) and message.get("role") in ("system", "developer")]


def of_chat(headers: Mapping[str, str], payload: Mapping[str, Any]) -> str | None:
    """An OpenAI chat completion's (and an Ollama chat's, whose messages are the same): its
    prompt_cache_key or session, else its system messages, tools and first user message; a
    legacy completion's prompt prefix."""
    model = str(payload.get("model", ""))
    if (key := _given(headers, model, payload.get("prompt_cache_key"))) is not None:
        return key
    messages = payload.get("messages")
    if messages is None:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            return None
        return _digest(model, "prompt", prompt[:PROMPT_PREFIX_CHARS])
    first = _first_user(messages)
    if first is None:
        return None
    return _digest(model, _system(messages), payload.get("tools"), first)


def of_messages(headers: Mapping[str, str], body: Mapping[str, Any]) -> str | None:
    """An Anthropic Messages request's: metadata.user_id (Claude Code's carries its session),
    else its system, tools and first user message."""
    model = str(body.get("model", ""))
    metadata = body.get("metadata")
    given = metadata.get("user_id") if isinstance(metadata, dict) else None
    if (key := _given(headers, model, given)) is not None:
        return key
    first = _first_user(body.get("messages"))
    if first is None:
        return None
    return _digest(model, body.get("system"), body.get("tools"), first)


def of_responses(headers: Mapping[str, str], payload: Mapping[str, Any]) -> str | None:
    """A Responses request's: prompt_cache_key (Codex sends one per session), else its
    instructions, tools and first user input."""
    model = str(payload.get("model", ""))
    if (key := _given(headers, model, payload.get("prompt_cache_key"))) is not None:
        return key
    first = _first_user(payload.get("input"))
    if first is None:
        return None
    return _digest(model, payload.get("instructions"), payload.get("tools"), first)


class Affinity:
    """The slot that last served each conversation: at most `size` of them, each for `ttl_s`
    after its last turn, the least recently used forgotten first."""

    def __init__(self, size: int = AFFINITY_SIZE, ttl_s: float = AFFINITY_TTL_S) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._slots: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._warm: dict[str, int] = {}  # how many conversations each slot holds

    def slot_for(self, conversation: str | None) -> str | None:
        if conversation is None or (held := self._slots.get(conversation)) is None:
            return None
        slot, when = held
        if time.monotonic() - when > self.ttl_s:
            self._drop(conversation)
            return None
        return slot

    def served(self, conversation: str | None, slot: str) -> None:
        """`slot` answered a turn of `conversation`: it holds it now."""
        if conversation is None:
            return
        self._drop(conversation)
        self._slots[conversation] = (slot, time.monotonic())
        self._warm[slot] = self._warm.get(slot, 0) + 1
        while len(self._slots) > self.size:
            self._drop(next(iter(self._slots)))

    def warm(self, slot: str) -> int:
        """How many conversations `slot` holds warm (their time to live not checked)."""
        return self._warm.get(slot, 0)

    def conversations(self, slot: str) -> list[str]:
        """`slot`'s conversations, the most recent first, as many as a saved cache names."""
        held = [key for key, (name, _) in reversed(self._slots.items()) if name == slot]
        return held[:SAVED_CONVERSATIONS]

    def forget_slot(self, slot: str) -> int:
        """`slot`'s process stopped without saving its caches: nothing of it is warm."""
        gone = [key for key, (name, _) in self._slots.items() if name == slot]
        for key in gone:
            self._drop(key)
        return len(gone)

    def adopt(self, slot: str, conversations: Iterable[str]) -> None:
        """A restored cache holds these conversations again (oldest first)."""
        for key in reversed(list(conversations)):
            if self.slot_for(key) is None:
                self.served(key, slot)

    def _drop(self, conversation: str) -> None:
        held = self._slots.pop(conversation, None)
        if held is None:
            return
        left = self._warm.get(held[0], 0) - 1
        if left > 0:
            self._warm[held[0]] = left
        else:
            self._warm.pop(held[0], None)
