"""Counting prompt tokens with the upstream's own tokenizer, for Anthropic's input_tokens.

The count should be what the model will really read: the messages *after* the chat template,
whose preamble (a default system prompt, role markers) is tens of tokens the raw text does not
have. Upstreams differ in how far they can tell:

    template  llama-server: POST /apply-template with the chat request answers the templated
              `prompt`; POST /tokenize of it, with the special tokens its completion adds (BOS)
              and parses, answers `tokens`. Exact.
    tokenize  vLLM: POST /tokenize with chat `messages` applies the template and answers `count`
              (exact); an older llama-server without /apply-template tokenizes the raw `content`
              (the template not counted). One body carries both shapes: each server ignores the
              other's fields.
    extras    llama-cpp-python: POST /extras/tokenize/count of the raw text (template not counted).
    estimate  nothing answers (a remote provider): chars / 4 of the raw text. Agents track their
              context from input_tokens, and 0 would break them.

The ways are tried in that order; the one that answers is remembered per slot, so an upstream
without /apply-template costs one 404 once, and one without any tokenizer three once, not on
every request. Where the template is not counted, the upstream's own usage, when its stream
reports one, still wins in message_delta (anthropic/stream.py).

Counting happens before the generation is requested, never beside it: llama-cpp-python's server
interrupts a running completion when another request arrives. It delays the request's first
frame, so it is bounded: TOKENIZE_TIMEOUT_S, except for a slot's first count (the first since
hal0d started, or one its caller says follows a load of the slot's process), which gets
FIRST_COUNT_TIMEOUT_S: right after a load llama-server's first /apply-template or /tokenize can
take seconds, and a short bound would turn the count of the one request that waited for the load
into an estimate. A count that fails is an estimate for that request, said in a
`tokens.estimated` line with its cause.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.transport.failures import upstream_errors
from hal0d.transport.upstream import OWN_ANSWER_LIMIT, UpstreamClient

log = get_logger()
TOKENIZE_TIMEOUT_S = 2.0
FIRST_COUNT_TIMEOUT_S = 10.0
TEMPLATE = "/apply-template"
TOKENIZE = "/tokenize"
EXTRAS = "/extras/tokenize/count"
WAYS = (TEMPLATE, TOKENIZE, EXTRAS)
SOURCE = {TEMPLATE: "template", TOKENIZE: "tokenize", EXTRAS: "extras"}
ESTIMATED = "estimate"  # the source of a count no tokenizer made
# Statuses that say "this server has no such endpoint"; any other failure may pass (a model still
# loading answers 503), so it is not remembered.
ABSENT_STATUSES = frozenset({400, 404, 405, 422})
# /apply-template judges the whole chat request: a 400 or 422 there is about this request (tools
# its template refuses), not the endpoint, so only these say it is missing.
NO_ENDPOINT_STATUSES = frozenset({404, 405})


class TryLater(Exception):
    pass


class NotThisRequest(Exception):
    """This way could not count this request; the next way may, and nothing is remembered."""


# The most bytes of answer a byte of what was sent may bring: a token of its own a byte at worst,
# as a JSON number of up to six digits and a comma (the templated prompt is about as long).
ANSWER_BYTES_PER_BYTE = 8


def answer_limit(sent: bytes) -> int:
    """The bound on a tokenizer's answer: it grows with the prompt it was sent, which may be
    far longer than what a server says about itself."""
    return OWN_ANSWER_LIMIT + ANSWER_BYTES_PER_BYTE * len(sent)


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
    def __init__(self, client: UpstreamClient) -> None:
        self.client = client
        # (slot name, upstream) -> the path that answered, or None when none did. Keyed by the
        # upstream too: a reload that points the slot at another server asks that one afresh.
        self._ways: dict[tuple[str, str], str | None] = {}
        # The slots whose first count is done: it answered, or had all of FIRST_COUNT_TIMEOUT_S
        # (a tokenizer that hangs makes one request wait that long, not every one). A quick
        # failure (a refused connect, a 503 while the model loads) leaves the next count first.
        self._counted: set[tuple[str, str]] = set()

    async def _post(self, slot: SlotConfig, path: str, body: dict[str, Any],
                    bound_s: float) -> Any:
        """The answer's JSON; None when the endpoint is not there (or answers no JSON)."""
        sent = orjson.dumps(body)
        status, data = await self.client.ask(
            slot, hdrs.METH_POST, path, body=sent, during="counting tokens",
            timeout_s=bound_s, refused_at="tokenizer", limit=answer_limit(sent),
        )
        if path == TEMPLATE and status in ABSENT_STATUSES - NO_ENDPOINT_STATUSES:
            raise NotThisRequest(f"{path} answered {status}")
        if status in ABSENT_STATUSES:
            return None
        if status != 200:
            raise TryLater(f"{path} answered {status}")
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return None

    async def _templated(self, slot: SlotConfig, openai_request: dict[str, Any],
                         bound_s: float) -> int | None:
        """llama-server's own template, then its tokenizer, as its chat completion does both."""
        # The whole chat request: the template also renders tools and chat_template_kwargs.
        answer = await self._post(slot, TEMPLATE, openai_request, bound_s)
        prompt = answer.get("prompt") if isinstance(answer, dict) else None
        if not isinstance(prompt, str):
            return None
        # add_special: the BOS its completion prepends; parse_special: the template's markers
        # are special tokens, one each, not text.
        body = {"content": prompt, "add_special": True, "parse_special": True}
        return _count_of(await self._post(slot, TOKENIZE, body, bound_s))

    async def _ask(
        self, slot: SlotConfig, path: str, openai_request: dict[str, Any], text: str,
        bound_s: float,
    ) -> int | None:
        if path == TEMPLATE:
            return await self._templated(slot, openai_request, bound_s)
        if path == TOKENIZE:
            body = {"model": openai_request.get("model"),
                    "messages": openai_request.get("messages"),
                    "content": text, "add_special": True, "parse_special": True}
        else:
            body = {"input": text}
        return _count_of(await self._post(slot, path, body, bound_s))

    async def count(
        self, slot: SlotConfig, openai_request: dict[str, Any], text: str, *,
        after_load: bool = False,
    ) -> tuple[int, str]:
        """(token count, where it came from: template, tokenize, extras or estimate).
        `after_load`: the request waited for the slot's process to load, so this count is that
        process's first (the module's docstring)."""
        key = (slot.name, slot.upstream)
        first = after_load or key not in self._counted
        bound_s = FIRST_COUNT_TIMEOUT_S if first else TOKENIZE_TIMEOUT_S
        known = self._ways.get(key, "unknown")
        if known == "unknown":
            ways: tuple[str, ...] = WAYS
        else:
            # The remembered way first; the ones after it stand in when it cannot count one
            # request (the ones before it are known to be missing).
            ways = WAYS[WAYS.index(known):] if known else ()
        conclusive = True
        try:
            # No descriptor for the count means none for the generation either: FdExhausted
            # passes, and the request gets its 503 now rather than an estimate and then the same.
            with upstream_errors(slot, "counting tokens", refused_at="tokenizer"):
                async with asyncio.timeout(bound_s):
                    for path in ways:
                        try:
                            count = await self._ask(slot, path, openai_request, text, bound_s)
                        except NotThisRequest as exc:
                            conclusive = False
                            log.debug("tokens.way_skipped", slot=slot.name, error=str(exc))
                            continue
                        if count is not None:
                            self._counted.add(key)
                            if conclusive and known != path:
                                self._ways[key] = path
                                log.info("tokens.way_chosen", slot=slot.name, way=SOURCE[path])
                            return count, SOURCE[path]
        except (UpstreamUnavailable, TryLater) as exc:
            if isinstance(exc, UpstreamUnavailable) and exc.kind == "timeout":
                self._counted.add(key)
            # A passing failure: an estimate for this request, the tokenizer asked next time.
            reason = (exc.cause if isinstance(exc, UpstreamUnavailable) else None) or str(exc)
            log.info("tokens.estimated", slot=slot.name, reason=reason, bound_s=bound_s,
                     fallback="estimate (chars / 4)")
            return estimate(text), ESTIMATED
        self._counted.add(key)
        if known == "unknown" and conclusive:
            self._ways[key] = None
            log.info("tokens.no_tokenizer", slot=slot.name, fallback="estimate (chars / 4)")
        return estimate(text), ESTIMATED

    def interrupts(self, slot: SlotConfig) -> bool:
        """Whether a count may interrupt a generation running on the slot's server: one whose
        tokenizer is llama-cpp-python's (extras), or not known yet to be another's."""
        return self._ways.get((slot.name, slot.upstream), EXTRAS) not in (TEMPLATE, TOKENIZE)
