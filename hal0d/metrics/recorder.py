"""The recorder: when a request ends, its RequestInfo becomes a history row, Prometheus figures
and per-slot live metrics, all at once and off the stream's path."""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from hal0d.appkeys import RECORDER, RUNTIME, SLOTS, SUPERVISOR
from hal0d.metrics.history import HistoryWriter, RequestRecord
from hal0d.metrics.live import SlotMetrics
from hal0d.metrics.prometheus import PromMetrics
from hal0d.metrics.tally import Tally
from hal0d.requestinfo import RequestInfo


class Recorder:
    def __init__(self, history: HistoryWriter, ttft_samples: int) -> None:
        self.history = history
        self.prom = PromMetrics()
        self.live: dict[str, SlotMetrics] = {}
        self._ttft_samples = ttft_samples
        self._dropped_seen = 0
        self.tally = Tally()

    def slot_metrics(self, slot: str) -> SlotMetrics:
        metrics = self.live.get(slot)
        if metrics is None:
            metrics = self.live[slot] = SlotMetrics.new(self._ttft_samples)
        return metrics

    def record(self, info: RequestInfo) -> None:
        self.tally.add(info.ts, info.ok)
        total_ms = info.total_ms
        self.history.submit(
            RequestRecord(
                ts=info.ts,
                request_id=info.request_id,
                slot=info.slot,
                model=info.model,
                endpoint=info.endpoint,
                stream=info.stream,
                status=info.status,
                ok=info.ok,
                error_code=info.error_code,
                queue_ms=info.queue_ms,
                load_ms=info.load_ms,
                ttft_ms=info.ttft_ms,
                total_ms=total_ms,
                prompt_tokens=info.prompt_tokens,
                completion_tokens=info.completion_tokens,
            )
        )
        if self.history.dropped > self._dropped_seen:
            self.prom.history_dropped.inc(self.history.dropped - self._dropped_seen)
            self._dropped_seen = self.history.dropped
        slot = info.slot or ""
        model = info.served_model or ""
        self.prom.requests.labels(slot, model, info.endpoint, info.error_code or "ok").inc()
        self.prom.duration.labels(slot, info.endpoint).observe(total_ms / 1000)
        if info.slot is None:
            return  # never reached a slot: a bad request, an unknown model
        if info.queue_ms is not None:
            self.prom.queue_wait.labels(slot).observe(info.queue_ms / 1000)
        if info.ttft_ms is not None:
            self.prom.ttft.labels(slot).observe(info.ttft_ms / 1000)
        if info.completion_tokens:
            self.prom.tokens.labels(slot, model).inc(info.completion_tokens)
        if info.error_code and info.error_code.startswith("stream_stall_"):
            self.prom.stall_trips.labels(slot, info.error_code.removeprefix("stream_stall_")).inc()
        live = self.slot_metrics(slot)
        live.record(
            ok=info.ok,
            ttft_ms=info.ttft_ms,
            completion_tokens=info.completion_tokens,
            tokens_per_s=info.tokens_per_s,
        )
        if info.usage:
            live.record_flm(info.usage)


async def recorder_context(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the history writer runs for the app's life and is flushed on shutdown."""
    config = app[RUNTIME].current.config
    history = HistoryWriter(config.database_path(), retention_days=config.metrics.retention_days)
    await history.start()
    recorder = Recorder(history, config.metrics.ttft_samples)

    def restarts() -> dict[str, int]:
        supervisor = app.get(SUPERVISOR)
        if supervisor is None:
            return {}
        return {name: process.restarts for name, process in supervisor.processes.items()}

    recorder.prom.watch_slots(lambda: app[SLOTS], recorder.live, restarts)
    app[RECORDER] = recorder
    yield
    await history.close()
