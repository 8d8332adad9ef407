"""Prometheus exposition for GET /metrics, built with prometheus_client (never hand-written).

Counters and histograms are updated once per finished request, off the stream's path. Slot
gauges (state, in flight, queued, process restarts, decode speed) are read from the live objects
at scrape time by a custom collector, so they can never drift from what /api/slots says. The
descriptor figures are the process's: `process_open_fds` and `process_max_fds` (prometheus_client's
process collector) and `hal0d_fd_exhausted_total`, the requests refused with a 503 because hal0d
had no descriptor free (descriptors.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hal0d import descriptors
from hal0d.metrics.live import SlotMetrics
from hal0d.slots import SlotState, SlotTable

# Seconds. LLM requests run from milliseconds (a cached embedding) to many minutes (a long turn).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)


class SlotCollector(Collector):
    def __init__(
        self,
        slots: Callable[[], SlotTable],
        live: Mapping[str, SlotMetrics],
        restarts: Callable[[], Mapping[str, int]],
    ) -> None:
        self._slots = slots
        self._live = live
        self._restarts = restarts

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        state = GaugeMetricFamily(
            "hal0d_slot_state", "1 for the state each slot is in", labels=["slot", "state"]
        )
        in_flight = GaugeMetricFamily(
            "hal0d_slot_in_flight", "requests being served by the slot", labels=["slot"]
        )
        queued = GaugeMetricFamily(
            "hal0d_slot_queued", "requests waiting for the slot", labels=["slot"]
        )
        speed = GaugeMetricFamily(
            "hal0d_slot_tokens_per_second", "decode speed of the slot's last stream",
            labels=["slot"],
        )
        restarts = CounterMetricFamily(
            "hal0d_upstream_process_restarts", "restarts of the slot's command", labels=["slot"]
        )
        restart_counts = self._restarts()
        for slot in self._slots():
            for candidate in SlotState:
                state.add_metric([slot.name, str(candidate)], 1.0 if slot.state == candidate else 0)
            in_flight.add_metric([slot.name], slot.in_flight)
            queued.add_metric([slot.name], slot.queued)
            live = self._live.get(slot.name)
            if live is not None and live.tokens_per_s is not None:
                speed.add_metric([slot.name], live.tokens_per_s)
            restarts.add_metric([slot.name], restart_counts.get(slot.name, 0))
        yield from (state, in_flight, queued, speed, restarts)


class DescriptorCollector(Collector):
    """The refusals counted by descriptors.report, which is process-wide like the fd table."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "hal0d_fd_exhausted",
            "requests refused (503) because hal0d had no file descriptor free",
            value=descriptors.report.refused_total,
        )


class PromMetrics:
    """One registry per application, so tests and reloads never share global state."""

    def __init__(self) -> None:
        # auto_describe off: the slot collector can only run once the slots exist.
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "hal0d_requests", "finished requests by outcome (ok or the error_code)",
            ["slot", "model", "endpoint", "outcome"], registry=self.registry,
        )
        self.duration = Histogram(
            "hal0d_request_duration_seconds", "whole request, streams until drained",
            ["slot", "endpoint"], buckets=DURATION_BUCKETS, registry=self.registry,
        )
        self.ttft = Histogram(
            "hal0d_ttft_seconds", "time to the first generated token", ["slot"],
            buckets=TTFT_BUCKETS, registry=self.registry,
        )
        self.queue_wait = Histogram(
            "hal0d_queue_wait_seconds", "wait for a free place on the slot", ["slot"],
            buckets=QUEUE_BUCKETS, registry=self.registry,
        )
        self.tokens = Counter(
            "hal0d_generated_tokens", "completion tokens generated", ["slot", "model"],
            registry=self.registry,
        )
        self.stall_trips = Counter(
            "hal0d_stall_guard_trips", "streams cut by the stall guard", ["slot", "reason"],
            registry=self.registry,
        )
        self.history_dropped = Counter(
            "hal0d_history_rows_dropped", "history rows dropped because the writer fell behind",
            registry=self.registry,
        )
        self.registry.register(DescriptorCollector())
        ProcessCollector(registry=self.registry)

    def watch_slots(
        self,
        slots: Callable[[], SlotTable],
        live: Mapping[str, SlotMetrics],
        restarts: Callable[[], Mapping[str, int]],
    ) -> None:
        self.registry.register(SlotCollector(slots, live, restarts))
