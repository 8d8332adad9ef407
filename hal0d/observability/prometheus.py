"""Prometheus exposition for GET /metrics, built with prometheus_client (never hand-written).

Counters and histograms are updated once per finished request, off the stream's path. Slot
gauges (state, in flight, queued, process restarts, decode speed) are read from the live objects
at scrape time by a custom collector, so they can never drift from what /api/slots says. The
descriptor figures are the process's: `process_open_fds` and `process_max_fds` (prometheus_client's
process collector) and `hal0d_fd_exhausted_total`, the requests refused with a 503 because hal0d
had no descriptor free (descriptors.py).

The model lifecycle (lifecycle/manager.py) is counted by `LifecycleMetrics`, an observer of it:
each load's outcome and duration when it ends, each unload with its reason. Whether a slot is
loaded and how much memory a group has in use are read from the slot table at scrape time, like
the gauges.

The devices' memory (hal0d/devices) is read from their last reading at scrape time too: each
device's total, used and free MiB, what each slot's processes hold there, and what no slot's
does (other programs, the driver). A scrape never reads a device itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from hal0d.devices import Reading
from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.room import Swap
from hal0d.lifecycle.slots import SlotState
from hal0d.lifecycle.table import SlotTable
from hal0d.lifecycle.vocabulary import LOADED, LoadPhase, SwapPhase, UnloadReason
from hal0d.observability.live import SlotMetrics
from hal0d.transport import descriptors

# Seconds. LLM requests run from milliseconds (a cached embedding) to many minutes (a long turn).
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)
QUEUE_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60)
# A stub starts in a fraction of a second, a large GGUF from a slow disk in minutes.
LOAD_BUCKETS = (0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)


class SlotPlacement(Protocol):
    """What the lifecycle gauges read of a slot's config (config.SlotConfig satisfies it)."""

    @property
    def group(self) -> str | None: ...
    @property
    def memory_mib(self) -> int | None: ...


# The collectors are handed what they read at scrape time (PromMetrics.watch_*). eq=False keeps
# the identity hash the registry keys its collectors by.
@dataclass(frozen=True, eq=False)
class SlotCollector(Collector):
    slots: Callable[[], SlotTable]
    live: Mapping[str, SlotMetrics]
    restarts: Callable[[], Mapping[str, int]]

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
        restart_counts = self.restarts()
        for slot in self.slots():
            for candidate in SlotState:
                state.add_metric([slot.name, str(candidate)], 1.0 if slot.state == candidate else 0)
            in_flight.add_metric([slot.name], slot.in_flight)
            queued.add_metric([slot.name], slot.queued)
            live = self.live.get(slot.name)
            if live is not None and live.tokens_per_s is not None:
                speed.add_metric([slot.name], live.tokens_per_s)
            restarts.add_metric([slot.name], restart_counts.get(slot.name, 0))
        yield from (state, in_flight, queued, speed, restarts)


@dataclass(frozen=True, eq=False)
class LifecycleCollector(Collector):
    """Loaded or not per slot, and the memory in use per group, read at scrape time.

    A slot counts as loaded while its process occupies its device (lifecycle.groups.LOADED: from the
    start of a load until its process is gone), which is what a group's limits count too."""

    slots: Callable[[], SlotTable]
    configs: Callable[[], Mapping[str, SlotPlacement]]
    groups: Callable[[], Iterator[str]]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        loaded = GaugeMetricFamily(
            "hal0d_slot_loaded", "1 while the slot's process is loaded (starting to stopping)",
            labels=["slot"],
        )
        memory = GaugeMetricFamily(
            "hal0d_group_memory_mib", "the memory_mib of the group's loaded slots, summed",
            labels=["group"],
        )
        configs = self.configs()
        in_use = dict.fromkeys(self.groups(), 0)
        for slot in self.slots():
            is_loaded = slot.state in LOADED
            loaded.add_metric([slot.name], 1.0 if is_loaded else 0.0)
            config = configs.get(slot.name)
            if is_loaded and config is not None and config.group is not None:
                in_use[config.group] = in_use.get(config.group, 0) + (config.memory_mib or 0)
        for group, mib in in_use.items():
            memory.add_metric([group], mib)
        yield from (loaded, memory)


@dataclass(frozen=True, eq=False)
class DeviceCollector(Collector):
    """The devices' memory from their last reading; a device not read now has no series."""

    reading: Callable[[], Reading]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        named = ["device", "name"]
        total = GaugeMetricFamily("hal0d_device_memory_total_mib", "the device's memory",
                                  labels=named)
        used = GaugeMetricFamily("hal0d_device_memory_used_mib", "the device's memory in use",
                                 labels=named)
        free = GaugeMetricFamily("hal0d_device_memory_free_mib", "the device's memory free",
                                 labels=named)
        slots = GaugeMetricFamily(
            "hal0d_device_slot_memory_mib", "the memory a slot's processes hold on the device",
            labels=["device", "slot"])
        other = GaugeMetricFamily(
            "hal0d_device_other_memory_mib", "the memory in use on the device that no slot's "
            "process holds (other programs, the driver)", labels=["device"])
        for device in self.reading().devices:
            index = str(device.index)
            total.add_metric([index, device.name], device.total_mib)
            used.add_metric([index, device.name], device.used_mib)
            free.add_metric([index, device.name], device.free_mib)
            for slot, mib in sorted(device.held_by_slots().items()):
                slots.add_metric([index, slot], mib)
            other.add_metric([index], device.other_mib)
        yield from (total, used, free, slots, other)


class LifecycleMetrics(LifecycleObserver):
    """The lifecycle manager's observer (LifecycleObserver): loads by outcome, their duration,
    unloads by reason, and each group's swaps with the wait for a turn they ended."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "hal0d_slot_loads", "finished loads of on-demand slots by outcome (ok or failed)",
            ["slot", "outcome"], registry=registry,
        )
        self.load_seconds = Histogram(
            "hal0d_slot_load_seconds", "a load, from its request to ready or failed",
            ["slot"], buckets=LOAD_BUCKETS, registry=registry,
        )
        self.unloads = Counter(
            "hal0d_slot_unloads", "unloads of on-demand slots by reason",
            ["slot", "reason"], registry=registry,
        )
        self.swaps = Counter(
            "hal0d_group_swaps", "swaps started in a group: a model unloaded for another's load",
            ["group"], registry=registry,
        )
        self.turn_wait = Histogram(
            "hal0d_group_turn_wait_seconds",
            "at each swap, how long the loading model's oldest request had waited for its turn",
            ["group"], buckets=LOAD_BUCKETS, registry=registry,
        )

    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        if phase not in (LoadPhase.READY, LoadPhase.FAILED):
            return  # the progress ticks of a load still running
        self.loads.labels(slot, "ok" if phase is LoadPhase.READY else "failed").inc()
        self.load_seconds.labels(slot).observe(elapsed_s)

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        self.unloads.labels(slot, str(reason)).inc()

    def swap(self, swap: Swap) -> None:
        if swap.phase is SwapPhase.STARTED:
            self.swaps.labels(swap.group).inc()
            self.turn_wait.labels(swap.group).observe(swap.waited_s)


class DescriptorCollector(Collector):
    """The refusals counted by descriptors.report, which is process-wide like the fd table."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "hal0d_fd_exhausted",
            "requests refused (503) because hal0d had no file descriptor free",
            value=descriptors.report.refused_total,
        )


@dataclass(frozen=True, eq=False)
class ConnectionCollector(Collector):
    closed: Callable[[], int]

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "hal0d_connections_closed", "connections hal0d closed, by reason", labels=["reason"])
        family.add_metric(["header_timeout"], self.closed())
        yield family


class PromMetrics:
    """One registry per application, so tests and reloads never share global state."""

    def __init__(self) -> None:
        # auto_describe off: the slot collector can only run once the slots exist.
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter(
            "hal0d_requests", "finished requests by outcome (ok or the error_code), and the "
            "name of the key they came with (empty without one)",
            ["slot", "model", "endpoint", "outcome", "key"], registry=self.registry,
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
        self.key_tokens = Counter(
            "hal0d_key_tokens", "tokens counted against each configured key (prompt and "
            "generated, from the answer's usage or an estimate): its quotas and its share",
            ["key"], registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "hal0d_prompt_tokens", "prompt tokens the upstream read (source=read) or took from "
            "its prompt cache (source=cached), of the requests whose upstream says which",
            ["slot", "source"], registry=self.registry,
        )
        self.stall_trips = Counter(
            "hal0d_stall_guard_trips", "streams cut by the stall guard", ["slot", "reason"],
            registry=self.registry,
        )
        self.failovers = Counter(
            "hal0d_failovers", "requests a route's slot handed on to the next before anything "
            "reached the client, by the slot that handed it on and why",
            ["route", "slot", "reason"], registry=self.registry,
        )
        self.keepalives = Counter(
            "hal0d_keepalives", "keepalive frames sent to streams waiting for their first byte "
            "(a queue, a load, a prefill), by surface", ["surface"], registry=self.registry,
        )
        self.history_dropped = Counter(
            "hal0d_history_rows_dropped", "history rows dropped because the writer fell behind",
            registry=self.registry,
        )
        self.lifecycle = LifecycleMetrics(self.registry)
        self.registry.register(DescriptorCollector())
        ProcessCollector(registry=self.registry)

    def failover(self, route: str, slot: str, reason: str) -> None:
        self.failovers.labels(route, slot, reason).inc()

    def keepalive(self, surface: str) -> None:
        self.keepalives.labels(surface).inc()

    def watch_slots(
        self,
        slots: Callable[[], SlotTable],
        live: Mapping[str, SlotMetrics],
        restarts: Callable[[], Mapping[str, int]],
    ) -> None:
        self.registry.register(SlotCollector(slots, live, restarts))

    def watch_connections(self, closed: Callable[[], int]) -> None:
        """The connections closed for sending no whole request head in time (HeadWatch)."""
        self.registry.register(ConnectionCollector(closed))

    def watch_devices(self, reading: Callable[[], Reading]) -> None:
        """The devices' last reading (devices.Devices.last)."""
        self.registry.register(DeviceCollector(reading))

    def watch_lifecycle(
        self,
        slots: Callable[[], SlotTable],
        configs: Callable[[], Mapping[str, SlotPlacement]],
        groups: Callable[[], Iterator[str]],
    ) -> None:
        self.registry.register(LifecycleCollector(slots, configs, groups))
