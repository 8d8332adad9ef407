"""The recorder: when a request ends, its RequestInfo becomes a history row, Prometheus figures
and per-slot live metrics, all at once and off the stream's path; and which requests are
logged, with the fields of their `request.done` line (which are recorded, their model calls, is
their surface's say: front/surfaces.py)."""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from typing import Any, Final

from hal0d.errors import stall_reason
from hal0d.keys import Key
from hal0d.observability.charges import charge_of
from hal0d.observability.history import COLUMNS, HistoryWriter, RequestRecord, row_of
from hal0d.observability.live import SlotMetrics, prompt_split
from hal0d.observability.prometheus import PromMetrics
from hal0d.observability.requestinfo import RequestInfo
from hal0d.observability.tally import Tally
from hal0d.shares.book import ShareBook
from hal0d.shares.quotas import LocalCounts, TokenCounts

# Polled by probes: noise in the log (their metrics still count).
UNLOGGED_PATHS: Final = frozenset({"/healthz", "/readyz"})
# The request.done line carries the history row's columns but `ts` (the line has its own time),
# with total_ms under the name the line always used.
_DONE_COLUMNS: Final = tuple(name for name in COLUMNS if name != "ts")
_DONE_NAMES: Final = tuple("duration_ms" if name == "total_ms" else name for name in _DONE_COLUMNS)
_done_values: Final = operator.attrgetter(*_DONE_COLUMNS)


def record_of(info: RequestInfo) -> RequestRecord:
    """The ended request's history row, made once: the recorder keeps it, the request.done
    line is written from it."""
    return RequestRecord(*row_of(info))


def done_fields(record: RequestRecord) -> dict[str, object]:
    """The request.done line's fields from the request's row, floats to two decimals."""
    return {name: round(value, 2) if type(value) is float else value
            for name, value in zip(_DONE_NAMES, _done_values(record), strict=True)}


class Recorder:
    def __init__(self, history: HistoryWriter, ttft_samples: int) -> None:
        self.history = history
        self.prom = PromMetrics()
        self.live: dict[str, SlotMetrics] = {}
        self._ttft_samples = ttft_samples
        self._dropped_seen = 0
        self.tally = Tally()
        # Told each history row as its request ends (the event feed).
        self.listeners: list[Callable[[RequestRecord], None]] = []
        # prometheus_client's labels() validates and locks on every call; a request's labels
        # repeat (a few slots, models, endpoints), so each child is looked up once and kept.
        self._children: dict[tuple[int, Hashable], Any] = {}
        # Where a request's tokens are charged when it ends (charges.py): its key's share of
        # the box and its quotas' counts (the app wires the ones the queues and keys read).
        self.book = ShareBook()
        self.counts: TokenCounts = LocalCounts()

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def slot_metrics(self, slot: str) -> SlotMetrics:
        metrics = self.live.get(slot)
        if metrics is None:
            metrics = self.live[slot] = SlotMetrics.new(self._ttft_samples)
        return metrics

    def charge(self, info: RequestInfo, key: Key, body_bytes: int | None) -> None:
        """The ended request's tokens, counted against its key (charges.py); a request without
        a key is not charged: without keys every request is one account with no quota."""
        tokens = charge_of(info, body_bytes)
        if tokens is None:
            return
        info.charged_tokens = tokens
        self.book.charge(key.share.account, tokens)
        if key.name is not None:
            self.counts.add(key.name, tokens, info.ts)
            self._child(self.prom.key_tokens, key.name).inc(tokens)

    def record(self, info: RequestInfo, record: RequestRecord) -> None:
        """The ended request's row (record_of) into the history and the feed, its figures into
        the metrics; `info` has what the row does not (the usage, the decode rate)."""
        self.tally.add()
        total_ms = record.total_ms or 0.0
        self.history.submit(record)
        for listener in self.listeners:
            listener(record)
        if self.history.dropped > self._dropped_seen:
            self.prom.history_dropped.inc(self.history.dropped - self._dropped_seen)
            self._dropped_seen = self.history.dropped
        slot = info.slot or ""
        model = info.served_model or ""
        self._child(self.prom.requests, slot, model, info.endpoint,
                    info.error_code or "ok", info.key or "").inc()
        self._child(self.prom.duration, slot, info.endpoint).observe(total_ms / 1000)
        if info.slot is None:
            return  # never reached a slot: a bad request, an unknown model
        if info.queue_ms is not None:
            self._child(self.prom.queue_wait, slot).observe(info.queue_ms / 1000)
        if info.ttft_ms is not None:
            self._child(self.prom.ttft, slot).observe(info.ttft_ms / 1000)
        if info.completion_tokens:
            self._child(self.prom.tokens, slot, model).inc(info.completion_tokens)
        if (split := prompt_split(info.prompt_tokens, info.cached_tokens)) is not None:
            self._child(self.prom.prompt_tokens, slot, "read").inc(split[0])
            self._child(self.prom.prompt_tokens, slot, "cached").inc(split[1])
        if (stall := stall_reason(info.error_code)) is not None:
            self._child(self.prom.stall_trips, slot, stall).inc()
        live = self.slot_metrics(slot)
        live.record(
            ok=info.ok,
            ttft_ms=info.ttft_ms,
            completion_tokens=info.completion_tokens,
            tokens_per_s=info.tokens_per_s,
            prompt_tokens=info.prompt_tokens,
            cached_tokens=info.cached_tokens,
        )
        if info.usage:
            live.record_flm(info.usage)
