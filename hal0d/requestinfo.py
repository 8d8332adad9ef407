"""What one request did, filled in as it goes from the handler to the upstream and back: the
`request.done` line, the history row and the Prometheus figures are all read from it, once, when
the request ends."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hal0d.metrics.live import StreamTap
from hal0d.relay import Outcome


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    ts: float = field(default_factory=time.time)
    model: str | None = None  # as the client named it
    served_model: str | None = None  # as the upstream knows it
    slot: str | None = None
    stream: bool = False
    status: int = 0
    ok: bool = True
    error_code: str | None = None
    queue_ms: float | None = None
    load_ms: float | None = None  # of queue_ms, the wait for the slot's model to load
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    tokens_per_s: float | None = None
    usage: dict[str, Any] | None = None
    ended: float | None = None

    def fail(self, error_code: str) -> None:
        self.ok = False
        if self.error_code is None:
            self.error_code = error_code

    def upstream_status(self, status: int) -> None:
        self.status = status
        if status >= 400:
            self.fail(f"upstream_status_{status}")

    def apply_usage(self, usage: dict[str, Any] | None) -> None:
        if not usage:
            return
        self.usage = usage
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.completion_tokens = completion

    def apply_stream(self, outcome: Outcome | None, tap: StreamTap | None) -> None:
        """What the relay saw; `outcome` is None when the relay was cancelled (client gone)."""
        if outcome is not None and not outcome.ok and outcome.error_code:
            self.fail(outcome.error_code)
        if tap is None:
            return
        self.ttft_ms = tap.ttft_ms
        self.apply_usage(tap.usage())
        if self.completion_tokens is None:
            self.completion_tokens = tap.completion_tokens()
        self.tokens_per_s = tap.decode_tokens_per_s()

    def end(self) -> None:
        if self.ended is None:
            self.ended = time.monotonic()

    @property
    def total_ms(self) -> float:
        return ((self.ended or time.monotonic()) - self.started) * 1000


INFO = web.RequestKey("hal0d_info", RequestInfo)
