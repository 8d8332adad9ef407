"""The tap: what a relayed stream shows of itself: time to first token, token counts, speed.

The tap sees every raw upstream chunk and must cost the stream nothing: after the first token,
per-chunk work is one substring count and one clock read. Only until the first token does it
look inside chunks, to skip llama-server's role-only opening chunk. It looks at one read at a
time, its lines cut as every event-stream reader cuts them (protocol.sse: at CR, LF and CRLF).

It reads three stream shapes the same way: chat completions chunks (`choices[].delta`), the
Responses API's events (`response.output_text.delta` and the other `*.delta` events carry their
text as a string `delta`; the final usage is `response.usage` in `response.completed`), and
Anthropic's (`content_block_delta`; usage in `message_delta`, as input_tokens/output_tokens). Every
shape has one `"delta"` key per generated piece, which is what the count after the first token
relies on.

How much of the prompt came from the upstream's cache (protocol/usage.py) is in the same last
reads: in the usage, or in llama-server's `timings` on its last chunk, usage or not. Only an
Anthropic stream says it earlier: `message_start`'s usage has input_tokens and
cache_read_input_tokens, which llama-server's `message_delta` does not repeat, so the tap keeps
that usage as it passes (before the first token, while it still looks inside chunks) and the
final usage is laid over it.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from hal0d.protocol.sse import data_lines
from hal0d.protocol.usage import with_timings
from hal0d.transport.stallguard import STALL_MARKER

# Fields of a chunk's delta (or legacy choice) that carry generated output.
_GENERATED = ("content", "reasoning_content", "reasoning", "tool_calls", "text")
# Fields of an Anthropic content_block_delta's delta that carry generated output.
_ANTHROPIC_GENERATED = ("text", "thinking", "partial_json")


def _carries_generated_text(chunk: bytes) -> bool:
    for data in data_lines(chunk):
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue  # [DONE], or an event split across reads: the next chunk decides
        if not isinstance(obj, dict):
            continue
        delta = obj.get("delta")
        if isinstance(delta, str) and delta:
            return True  # a Responses API `*.delta` event
        if obj.get("type") == "content_block_delta" and isinstance(delta, dict):
            if any(delta.get(name) for name in _ANTHROPIC_GENERATED):
                return True
            continue
        choices = obj.get("choices")
        if not isinstance(choices, list):
            continue
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            source = delta if isinstance(delta, dict) else choice
            if any(source.get(name) for name in _GENERATED):
                return True
    return False


def _usage_of(chunk: bytes) -> tuple[dict[str, Any] | None, Any]:
    """The last usage in `chunk` as it came (a chunk's `usage`, the Responses API's
    `response.usage`, Anthropic's `message.usage` in message_start), and the last `timings`."""
    usage = timings = None
    for data in data_lines(chunk):
        if b'"usage"' not in data and b'"timings"' not in data:
            continue
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        found = obj.get("usage")
        for outer in ("response", "message"):  # response.completed's, message_start's
            if found is None and isinstance(inner := obj.get(outer), dict):
                found = inner.get("usage")
        if isinstance(found, dict):
            usage = found
        if obj.get("timings") is not None:
            timings = obj["timings"]
    return usage, timings


def normal_usage(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """Usage as chat completions name it: the Responses and Anthropic APIs say input_tokens and
    output_tokens where chat completions say prompt_tokens and completion_tokens. Anthropic's
    input_tokens leaves out the prompt's cached part (cache_read_input_tokens) and what was
    written to the cache (cache_creation_input_tokens); prompt_tokens is the whole prompt."""
    if usage is None or "completion_tokens" in usage or "output_tokens" not in usage:
        return usage
    prompt = usage.get("input_tokens")
    if type(prompt) is int:
        for part in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            if type(tokens := usage.get(part)) is int:
                prompt += tokens
    return {**usage, "prompt_tokens": prompt, "completion_tokens": usage["output_tokens"]}


class StreamTap:
    """Observes one stream's raw upstream bytes without altering them."""

    __slots__ = ("_before_last", "_last", "_opening", "first_token_at", "last_chunk_at",
                 "started", "tokens")

    def __init__(self, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        self.first_token_at: float | None = None
        self.last_chunk_at: float | None = None
        self.tokens = 0
        # The last two reads: a usage chunk comes last, just before [DONE] (on vLLM with
        # continuous usage, on every chunk, the last one being final); read once, at the end.
        self._before_last = b""
        self._last = b""
        self._opening: dict[str, Any] | None = None  # an Anthropic message_start's usage

    def on_chunk(self, chunk: bytes) -> None:
        now = time.monotonic()
        if self.first_token_at is None:
            if b'"message_start"' in chunk:
                self._opening = _usage_of(chunk)[0]
            if STALL_MARKER in chunk or not _carries_generated_text(chunk):
                return
            self.first_token_at = now
        # Approximate: one delta per generated token, as llama-server and vLLM stream them.
        self.tokens += chunk.count(b'"delta"')
        self.last_chunk_at = now
        self._before_last, self._last = self._last, chunk

    @property
    def ttft_ms(self) -> float | None:
        if self.first_token_at is None:
            return None
        return (self.first_token_at - self.started) * 1000

    def usage(self) -> dict[str, Any] | None:
        """The stream's usage in chat completions' words, what llama-server's timings add to it
        included (protocol/usage.py)."""
        # Joined: the last event may have been split across the two reads.
        usage, timings = _usage_of(self._before_last + self._last)
        if self._opening is not None:  # message_delta's counts are totals: they win
            usage = {**self._opening, **{k: v for k, v in (usage or {}).items() if v is not None}}
        return with_timings(normal_usage(usage), timings)

    def completion_tokens(self) -> int | None:
        usage = self.usage()
        reported = usage.get("completion_tokens") if usage else None
        if isinstance(reported, int):
            return reported
        return self.generated() if self.first_token_at is not None else None

    def generated(self) -> int:
        """The deltas counted, less the closing chunk's empty one (it carries the finish_reason
        and generated nothing): looked for once, in the last reads, not in every chunk."""
        return self.tokens - (self._before_last + self._last).count(b'"delta":{}')

    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first over the time since it: the model's decoding speed."""
        tokens = self.generated()
        if self.first_token_at is None or self.last_chunk_at is None or tokens < 2:
            return None
        span = self.last_chunk_at - self.first_token_at
        return (tokens - 1) / span if span > 0 else None
