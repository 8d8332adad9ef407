"""What one request did, filled in as it goes from the handler to the upstream and back: the
`request.done` line, the history row and the Prometheus figures are all read from it, once, when
the request ends. Its fields carry the names of the history's columns (hal0d.observability.history
.RequestRecord), which are filled from them by name."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from hal0d.errors import ErrorCode, upstream_status
from hal0d.lifecycle.turns import ANONYMOUS
from hal0d.protocol.usage import cached_tokens, with_timings

# What an upstream's error status can be read as, its body said why: a 400 that is its context
# error is recorded as context_exceeded, as hal0d's own refusal of such a prompt is.
READ_IN_BODY = frozenset({ErrorCode.CONTEXT_EXCEEDED})


@dataclass(slots=True)
class RequestInfo:
    request_id: str
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    ts: float = field(default_factory=time.time)
    model: str | None = None  # as the client named it
    served_model: str | None = None  # as the upstream knows it
    slot: str | None = None
    # The name of the [[keys]] entry the request came in with (never the secret); None without
    # keys. It is the client whose turn a slot's queue takes (see the swaps issue).
    key: str | None = None
    stream: bool = False
    status: int = 0
    ok: bool = True
    error_code: str | None = None
    queue_ms: float | None = None
    load_ms: float | None = None  # of queue_ms, the wait for the slot's model to load
    turn_ms: float | None = None  # of load_ms, the wait for the model's turn in its group
    ttft_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    context_tokens: int | None = None  # the context a refused prompt did not fit (context_guard)
    dropped_messages: int | None = None  # the oldest messages Ollama's surface left out to fit
    service_class: str | None = None  # its key's class, once it went to a slot (hal0d/shares)
    charged_tokens: int | None = None  # counted against its key when it ended (charges.py)
    # Of prompt_tokens, those the upstream took from its prompt cache (None: it did not say).
    cached_tokens: int | None = None
    tokens_per_s: float | None = None
    usage: dict[str, Any] | None = None
    ended: float | None = None
    # The client had the whole answer before the request ended (a stream's terminal frame was
    # written): a cancellation after that is the client closing, not a disconnect.
    answered: bool = False
    # A route's way: the slots tried (1 without a hand-on), and those that handed it on with
    # why (`slot=reason,...`), None when the first answered.
    attempts: int = 1
    failover: str | None = None

    def fail(self, error_code: str) -> None:
        """The request ended badly: its first cause is the one kept, except that an upstream's
        error status, a bare number, gives way to what hal0d read in its body (READ_IN_BODY)."""
        self.ok = False
        if self.error_code is None or (error_code in READ_IN_BODY
                                       and self.error_code.startswith(ErrorCode.UPSTREAM_STATUS)):
            self.error_code = error_code

    def upstream_status(self, status: int) -> None:
        self.status = status
        if status >= 400:
            self.fail(upstream_status(status))

    def apply_usage(self, usage: dict[str, Any] | None, timings: object = None) -> None:
        """The upstream's usage in chat completions' words (transport.tap.normal_usage), and
        llama-server's `timings` where the answer has them: the cached part is read from either
        (hal0d.protocol.usage), the usage's figure first."""
        usage = with_timings(usage, timings)
        if not usage:
            return
        self.usage = usage
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        if isinstance(completion, int):
            self.completion_tokens = completion
        if (cached := cached_tokens(usage)) is not None:
            self.cached_tokens = cached

    def end(self) -> None:
        if self.ended is None:
            self.ended = time.monotonic()

    @property
    def total_ms(self) -> float:
        return ((self.ended or time.monotonic()) - self.started) * 1000


def client_of(info: RequestInfo, payload: Mapping[str, Any] | None) -> str:
    """Who the request is for its turn in a slot's queue: the name of the key it came with; else
    the body's OpenAI `user` or Anthropic `metadata.user_id`; else the single anonymous client
    (so without keys and such fields the queue stays first come, first served)."""
    if info.key:
        return f"key:{info.key}"
    if payload is not None:
        user = payload.get("user")
        if not isinstance(user, str) or not user:
            metadata = payload.get("metadata")
            user = metadata.get("user_id") if isinstance(metadata, Mapping) else None
        if isinstance(user, str) and user:
            return f"user:{user}"
    return ANONYMOUS


INFO = web.RequestKey("hal0d_info", RequestInfo)
