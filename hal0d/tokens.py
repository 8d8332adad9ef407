"""Counting prompt tokens with the upstream's own tokenizer, for Anthropic's input_tokens.

Upstreams disagree on where and how: vLLM serves POST /tokenize with chat `messages` (template
applied) and answers `count`; llama-server serves POST /tokenize with `content` and answers
`tokens`; llama-cpp-python serves POST /extras/tokenize/count with `input`. One /tokenize body
carries both shapes (each server ignores the other's fields), llama-cpp-python's path is the
fallback, and when nothing answers a chars/4 estimate stands in: agents track their context from
input_tokens, and 0 would break them. Which way works is remembered per slot, so an upstream
without a tokenizer (a remote provider) costs two failed look-ups once, not on every request.

Counting happens before the generation is requested, never beside it: llama-cpp-python's server
interrupts a running completion when another request arrives.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.upstream import own_headers, upstream_errors

log = get_logger()
TOKENIZE_TIMEOUT_S = 2.0
TOKENIZE = "/tokenize"
EXTRAS = "/extras/tokenize/count"
SOURCE = {TOKENIZE: "tokenize", EXTRAS: "extras"}
# Statuses that say "this server has no such endpoint"; any other failure may pass (a model still
# loading answers 503), so it is not remembered.
ABSENT_STATUSES = frozenset({400, 404, 405, 422})


class TryLater(Exception):
    pass


def estimate(text: str) -> int:
    return max(1, len(text) // 4)


def _count_of(answer: Any) -> int | None:
    if not isinstance(answer, dict):
        return None
    count = answer.get("count")
    if isinstance(count, int) and not isinstance(count, bool):
        return count
    tokens = answer.get("tokens")
    if isinstance(tokens, list) and tokens:
        return len(tokens)
    return None


class TokenCounter:
    def __init__(self, session: aiohttp.ClientSession) -> None:
        self.session = session
        # (slot name, upstream) -> the path that answered, or None when none did. Keyed by the
        # upstream too: a reload that points the slot at another server asks that one afresh.
        self._ways: dict[tuple[str, str], str | None] = {}

    async def _ask(self, slot: SlotConfig, path: str, body: dict[str, Any]) -> int | None:
        headers = own_headers(slot)
        headers[hdrs.CONTENT_TYPE] = "application/json"
        async with self.session.post(
            slot.upstream + path, data=orjson.dumps(body), headers=headers
        ) as resp:
            if resp.status in ABSENT_STATUSES:
                return None
            if resp.status != 200:
                raise TryLater(f"{path} answered {resp.status}")
            try:
                return _count_of(orjson.loads(await resp.read()))
            except orjson.JSONDecodeError:
                return None

    async def count(
        self, slot: SlotConfig, openai_request: dict[str, Any], text: str
    ) -> tuple[int, str]:
        """(token count, where it came from: tokenize, extras or estimate)."""
        bodies: dict[str, dict[str, Any]] = {
            TOKENIZE: {
                "model": openai_request.get("model"),
                "messages": openai_request.get("messages"),
                "content": text,
                "add_special": True,
            },
            EXTRAS: {"input": text},
        }
        key = (slot.name, slot.upstream)
        known = self._ways.get(key, "unknown")
        ways = [TOKENIZE, EXTRAS] if known == "unknown" else [known] if known else []
        try:
            # No descriptor for the count means none for the generation either: FdExhausted
            # passes, and the request gets its 503 now rather than an estimate and then the same.
            with upstream_errors(slot, "counting tokens", refused_at="tokenizer"):
                async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
                    for path in ways:
                        count = await self._ask(slot, path, bodies[path])
                        if count is not None:
                            self._ways[key] = path
                            return count, SOURCE[path]
        except (UpstreamUnavailable, TryLater) as exc:
            log.debug("tokens.count_failed", slot=slot.name, error=str(exc))
            return estimate(text), "estimate"  # a passing failure: try the tokenizer next time
        if known == "unknown":
            self._ways[key] = None
            log.info("tokens.no_tokenizer", slot=slot.name, fallback="estimate (chars / 4)")
        return estimate(text), "estimate"

