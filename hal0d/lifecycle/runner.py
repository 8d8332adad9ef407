"""What the lifecycle manager keeps for each slot with a command (Runner: its process, its task,
its timers, its backoff), and the words it tells its observers (load phases, unload reasons).
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final, Protocol

from hal0d.config import GroupConfig, SlotConfig
from hal0d.lifecycle.groups import Swap
from hal0d.lifecycle.process import Child
from hal0d.lifecycle.slots import Slot, SlotState
from hal0d.logs import get_logger

log = get_logger()

BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 60.0
LOAD_TICK_S: Final = 1.0


class UnloadReason(enum.StrEnum):
    IDLE = "idle"
    EVICTED = "evicted"
    API = "api"
    RELOAD = "reload"
    SHUTDOWN = "shutdown"


class LoadPhase(enum.StrEnum):
    WAITING_FOR_ROOM = "waiting_for_room"
    STARTING = "starting"
    PROBING = "probing"
    READY = "ready"
    FAILED = "failed"
    WITHDRAWN = "withdrawn"  # no request waited for it any more: nothing was loaded


class LifecycleObserver(Protocol):
    """Told what the manager does, for the event feed and the metrics (never the slot's own
    state changes: those reach Slot.watchers)."""

    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        """A start's phase; repeated every LOAD_TICK_S while it lasts."""

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None: ...

    def swap(self, swap: Swap) -> None:
        """A step of a swap in a group: planned, started (the victim drains), done."""


PhaseTeller = Callable[[str, "LoadPhase", float, "str | None"], None]


def log_state_change(slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
    if new == SlotState.SERVING or (old == SlotState.SERVING and new == SlotState.READY):
        return  # every lease would log twice; in_flight is in /api/slots and /metrics instead
    level = log.warning if new == SlotState.ERROR else log.info
    level("slot.state_changed", slot=slot.name, old=str(old), new=str(new), reason=reason)


@dataclass
class Backoff:
    """The pause before a failed or exited process is started again: 1 s, doubling to 60 s."""

    next_s: float = BACKOFF_FIRST_S

    def take(self) -> float:
        delay = self.next_s
        self.next_s = min(delay * 2, BACKOFF_MAX_S)
        return delay

    def reset(self) -> None:
        self.next_s = BACKOFF_FIRST_S


@dataclass(eq=False)
class Runner:
    """What the manager keeps for one slot with a command: its process, its one task (a start
    or a stop), its watch, its timers."""

    slot: Slot
    config: SlotConfig
    child: Child | None = None
    job: asyncio.Task[None] | None = None
    watch: asyncio.Task[None] | None = None
    retry: asyncio.TimerHandle | None = None
    idle_timer: asyncio.TimerHandle | None = None
    backoff: Backoff = field(default_factory=Backoff)
    retry_in_s: float = 0.0  # the backoff of the last failure, for its actions
    cause: str | None = None  # why the last start failed
    last_used: float = field(default_factory=time.monotonic)
    loaded_at: float | None = None
    restarts: int = 0
    unloading: UnloadReason = UnloadReason.API
    drain_s: float | None = None  # the bound of the unload's drain (a reload's), None: none
    successor: SlotConfig | None = None  # a reload's config, taken on once the process is gone
    # This load's idle timer as a client asked for it (Ollama's keep_alive), in place of
    # idle_unload_s until the slot unloads: 0 unloads once idle, negative never.
    keep_alive_s: float | None = None
    urgent: bool = False  # the next start was asked for by the API: it waits for no batch

    @property
    def name(self) -> str:
        return self.slot.name

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()

    def wanted(self) -> bool:
        """An `always` slot is wanted all the time; an on-demand one while requests are there."""
        return not self.config.on_demand or bool(self.slot.queued or self.slot.in_flight)

    def idle_unload_s(self) -> float | None:
        """How long this load may stay idle before it unloads; None: for ever."""
        if not self.config.on_demand:
            return None
        if self.keep_alive_s is not None:
            return None if self.keep_alive_s < 0 else self.keep_alive_s
        return self.config.idle_unload_s or None

    def cancel_timers(self) -> None:
        for timer in (self.retry, self.idle_timer):
            if timer is not None:
                timer.cancel()
        self.retry = self.idle_timer = None


class Progress:
    """A start's current phase, told to the observers at once and every LOAD_TICK_S."""

    def __init__(self, tell: PhaseTeller, slot: str) -> None:
        self.tell = tell
        self.slot = slot
        self.started = time.monotonic()
        self.phase = LoadPhase.STARTING
        self._ticker: asyncio.Task[None] | None = None

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def enter(self, phase: LoadPhase, reason: str | None = None) -> None:
        self.phase = phase
        self.tell(self.slot, phase, self.elapsed(), reason)
        if phase in (LoadPhase.READY, LoadPhase.FAILED):
            self.stop()
        elif self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(LOAD_TICK_S)
            self.tell(self.slot, self.phase, self.elapsed(), None)

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None


@dataclass(frozen=True)
class ConfigDiff:
    """What a reload changes in [[slots]] and [groups]."""

    added: tuple[SlotConfig, ...]
    removed: tuple[str, ...]
    changed: tuple[SlotConfig, ...]
    groups: dict[str, GroupConfig]

    @classmethod
    def between(cls, before: dict[str, SlotConfig], after: Iterable[SlotConfig],
                groups: dict[str, GroupConfig]) -> ConfigDiff:
        new = {c.name: c for c in after}
        return cls(
            added=tuple(c for name, c in new.items() if name not in before),
            removed=tuple(name for name in before if name not in new),
            changed=tuple(c for name, c in new.items() if name in before and c != before[name]),
            groups=groups,
        )

    def names(self) -> dict[str, list[str]]:
        return {"added": [c.name for c in self.added], "removed": list(self.removed),
                "changed": [c.name for c in self.changed]}
