"""Live metrics per slot, since hal0d started: the figures of GET /api/slots/metrics."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SlotMetrics:
    """What one slot has shown since start: the figures of GET /api/slots/metrics."""

    ttft_ms: deque[float]
    requests: int = 0
    errors: int = 0
    tokens: int = 0
    tokens_per_s: float | None = None
    flm: dict[str, float] = field(default_factory=dict)
    # The prompt tokens of the requests whose upstream said how many came from its cache: those
    # it read, and those it took from the cache (their share is the status page's "cache").
    prompt_read: int = 0
    prompt_cached: int = 0

    @classmethod
    def new(cls, samples: int) -> SlotMetrics:
        return cls(ttft_ms=deque(maxlen=samples))

    def record(
        self,
        *,
        ok: bool,
        ttft_ms: float | None,
        completion_tokens: int | None,
        tokens_per_s: float | None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        self.requests += 1
        if (split := prompt_split(prompt_tokens, cached_tokens)) is not None:
            self.prompt_read += split[0]
            self.prompt_cached += split[1]
        if not ok:
            self.errors += 1
        if ttft_ms is not None:
            self.ttft_ms.append(ttft_ms)
        if completion_tokens:
            self.tokens += completion_tokens
        if tokens_per_s is not None:
            self.tokens_per_s = tokens_per_s

    def record_flm(self, usage: dict[str, Any]) -> None:
        for key in ("decoding_speed_tps", "kv_token_occupancy_rate_percentage"):
            value = usage.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.flm[key] = float(value)
        if "decoding_speed_tps" in usage and "decoding_speed_tps" in self.flm:
            self.tokens_per_s = self.flm["decoding_speed_tps"]

    def snapshot(self) -> dict[str, Any]:
        samples = sorted(self.ttft_ms)

        def pct(p: float) -> float | None:
            if not samples:
                return None
            return round(samples[min(len(samples) - 1, int(p * len(samples)))], 3)

        out: dict[str, Any] = {
            "requests": self.requests,
            "errors": self.errors,
            "tokens": self.tokens,
            "tokens_per_s": round(self.tokens_per_s, 3) if self.tokens_per_s else None,
            "ttft_ms": {
                "last": round(self.ttft_ms[-1], 3) if self.ttft_ms else None,
                "p50": round(statistics.median(samples), 3) if samples else None,
                "p95": pct(0.95),
                "samples": len(samples),
            },
            "prompt_tokens": {"read": self.prompt_read, "cached": self.prompt_cached},
        }
        out.update(self.flm)
        return out


def prompt_split(prompt_tokens: int | None, cached_tokens: int | None) -> tuple[int, int] | None:
    """A request's prompt as (read, taken from the cache) when its upstream said both; None when
    it said nothing of a cache (llama-cpp-python does not): no figure, not a cache that held
    nothing."""
    if prompt_tokens is None or cached_tokens is None:
        return None
    cached = min(cached_tokens, prompt_tokens)
    return prompt_tokens - cached, cached
