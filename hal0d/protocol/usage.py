"""How much of a prompt the upstream took from its prompt cache, read the same way from every API
that says it (pure).

    chat completions (llama-server, vLLM, OpenAI)   usage.prompt_tokens_details.cached_tokens
    the Responses API                               usage.input_tokens_details.cached_tokens
    Anthropic's Messages API                        usage.cache_read_input_tokens
    llama-server's `timings`, beside the usage      cache_n (taken from the cache), prompt_n (read)

The usage's figure wins over `timings` when both are there. llama-server sends `timings` on a
whole answer and on the last chunk of a stream, usage only when the client asked for it
(stream_options.include_usage), so a stream without usage still tells its cache through them.

What "the prompt" counts differs: chat completions' prompt_tokens and the Responses API's
input_tokens are the whole prompt, the cached part included; Anthropic's input_tokens is only what
was read beyond the cache (the prompt is input_tokens + cache_read_input_tokens +
cache_creation_input_tokens). hal0d keeps chat completions' sense: prompt_tokens is the whole
prompt, cached_tokens the part of it that came from the cache.

These figures are reported, never acted on, so they are read, not checked: one that is not a
count is no figure (a stream is never failed for it).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["cached_tokens", "with_timings"]


def cached_tokens(usage: Mapping[str, Any] | None, timings: object = None) -> int | None:
    """The cached part of the prompt as `usage` (in any of the three APIs' words) or, failing
    that, llama-server's `timings` say it; None when neither does."""
    if usage:
        for details in (usage.get("prompt_tokens_details"), usage.get("input_tokens_details")):
            found = _count(details.get("cached_tokens")) if isinstance(details, Mapping) else None
            if found is not None:
                return found
        found = _count(usage.get("cache_read_input_tokens"))
        if found is not None:
            return found
    return _count(timings.get("cache_n")) if isinstance(timings, Mapping) else None


def with_timings(usage: dict[str, Any] | None, timings: object) -> dict[str, Any] | None:
    """`usage` with what llama-server's `timings` add to it, in chat completions' words: the
    cached part where the usage names none, and prompt_tokens (cache_n + prompt_n) where it has
    no count of its own. `usage` as it came when there are no timings to add."""
    if not isinstance(timings, Mapping) or (cached := _count(timings.get("cache_n"))) is None:
        return usage
    out = dict(usage) if usage else {}
    if cached_tokens(out) is None:
        details = out.get("prompt_tokens_details")
        out["prompt_tokens_details"] = {**(details if isinstance(details, Mapping) else {}),
                                        "cached_tokens": cached}
    read = _count(timings.get("prompt_n"))
    if _count(out.get("prompt_tokens")) is None and read is not None:
        out["prompt_tokens"] = cached + read
    return out


def _count(value: object) -> int | None:
    """`value` when it is a count of tokens (an int >= 0, not a bool), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None
