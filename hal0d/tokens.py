"""Counting prompt tokens with the upstream's own tokenizer, for Anthropic's input_tokens.

Upstreams disagree on where and how: vLLM serves POST /tokenize with chat `messages` (template
applied) and answers `count`; llama-server serves POST /tokenize with `content` and answers
`tokens`; llama-cpp-python serves POST /extras/tokenize/count with `input`. One /tokenize body
carries both shapes (each server ignores the other's fields), llama-cpp-python's path is the
fallback, and when nothing answers a chars/4 estimate stands in: agents track their context from
input_tokens, and 0 would break them.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson

from hal0d.config import SlotConfig
from hal0d.logs import get_logger

log = get_logger()
TOKENIZE_TIMEOUT_S = 2.0


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


async def _ask(session: aiohttp.ClientSession, slot: SlotConfig, path: str,
               body: dict[str, Any]) -> int | None:
    headers = {"Content-Type": "application/json"}
    token = slot.bearer_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    async with session.post(slot.upstream + path, data=orjson.dumps(body),
                            headers=headers) as resp:
        if resp.status != 200:
            return None
        try:
            return _count_of(orjson.loads(await resp.read()))
        except orjson.JSONDecodeError:
            return None


async def count_prompt_tokens(
    session: aiohttp.ClientSession, slot: SlotConfig, openai_request: dict[str, Any], text: str
) -> tuple[int, str]:
    """(token count, where it came from: tokenize | extras | estimate)."""
    tokenize_body = {
        "model": openai_request.get("model"),
        "messages": openai_request.get("messages"),
        "content": text,
        "add_special": True,
    }
    try:
        async with asyncio.timeout(TOKENIZE_TIMEOUT_S):
            count = await _ask(session, slot, "/tokenize", tokenize_body)
            if count is not None:
                return count, "tokenize"
            count = await _ask(session, slot, "/extras/tokenize/count", {"input": text})
            if count is not None:
                return count, "extras"
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        log.debug("tokens.count_failed", slot=slot.name, error=f"{type(exc).__name__}: {exc}")
    return estimate(text), "estimate"
