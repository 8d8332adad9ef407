"""The last hour of the slots' lives, for GET /api/timeline and the status page's timeline: when
each load began, ended or failed, each unload and why, each step of a swap.

``LifecycleLog`` is told these as a lifecycle observer (and, as a watcher of the slots, a process
that went away with no unload, a slot that went into `error` and one that answers again), and
keeps them in memory: at most `size` events, none
older than `keep_s`, so it costs the same after a week as after an hour. Each event is also
handed to `keep` (the history writer's queue, its `lifecycle` table), and a new run begins with
the last hour read back (`restore`), so the page's last hour survives a restart; a slot the
previous run left loaded (it ended without unloading it: a crash) is marked `stopped` at the
restart. Every method is a plain append: no await, no I/O, nothing on a request's way.

``spans`` turns the events into what the timeline draws, per slot: from when to when it was
loading, loaded and in error. What happened before the log's horizon is inferred from the first
event kept (an unload means it was loaded until then) or, with no event at all, from the slot's
state now.

``FreeMemory`` runs a group's `free_memory_command` for the timeline's memory figures, at most
once per `every_s` per group, so a page left open does not run nvidia-smi on every refresh.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import orjson

from hal0d.config import GroupConfig
from hal0d.lifecycle.groups import free_memory_mib
from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import UP, SlotState
from hal0d.observability.history import LifecycleRow

if TYPE_CHECKING:
    from hal0d.lifecycle.room import Swap
    from hal0d.lifecycle.vocabulary import LoadPhase, UnloadReason

KEEP_S: Final = 3600.0
SIZE: Final = 2000
FREE_MEMORY_EVERY_S: Final = 30.0
LOADING_PHASES: Final = frozenset({"waiting_for_room", "starting", "probing"})
AT_REST: Final = frozenset({SlotState.STOPPED, SlotState.OFFLINE})


@dataclass(frozen=True, slots=True)
class Span:
    slot: str
    state: str  # loading | loaded | error
    start: float
    end: float | None  # None: it still is
    outcome: str | None = None  # how a loading span ended: loaded, failed, withdrawn


class LifecycleLog(LifecycleObserver):
    def __init__(self, keep_s: float = KEEP_S, size: int = SIZE,
                 clock: Callable[[], float] = time.time,
                 keep: Callable[[LifecycleRow], None] | None = None) -> None:
        self.keep_s = keep_s
        self.clock = clock
        self.started = clock()
        self._keep = keep
        self._events: collections.deque[dict[str, Any]] = collections.deque(maxlen=size)
        self._loading: set[str] = set()  # a load began and has not ended: its ticks are not news
        self._up: set[str] = set()  # loaded, as far as the events told

    def _add(self, slot: str, kind: str, **fields: Any) -> None:
        event = {"ts": self.clock(), "slot": slot, "kind": kind, **fields}
        self._events.append(event)
        if self._keep is not None:
            self._keep(LifecycleRow(event["ts"], slot, kind, orjson.dumps(fields).decode()))

    def restore(self, rows: Iterable[LifecycleRow]) -> None:
        """The previous runs' events (oldest first), before this run's: the log then speaks for
        the time since the first of them."""
        restored = [{"ts": row.ts, "slot": row.slot, "kind": row.kind, **orjson.loads(row.detail)}
                    for row in rows]
        if not restored:
            return
        left_open: set[str] = set()  # loading or loaded when the previous run's events end
        for event in restored:
            kind = event["kind"]
            if kind in ("load", "loaded", "error", "recovered"):
                left_open.add(event["slot"])
            elif kind in ("unload", "stopped") or kind.startswith("load_"):
                left_open.discard(event["slot"])
        marks = [{"ts": self.started, "slot": slot, "kind": "stopped",
                  "reason": "hal0d restarted"} for slot in sorted(left_open)]
        self._events.extendleft(reversed([*restored, *marks]))
        self.started = min(self.started, restored[0]["ts"])

    # LifecycleObserver (lifecycle/manager.py)
    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        name = str(phase)
        if name in LOADING_PHASES:
            if slot not in self._loading:
                self._loading.add(slot)
                self._up.discard(slot)
                self._add(slot, "load")
            return
        self._loading.discard(slot)
        if name == "ready":
            self._up.add(slot)
            self._add(slot, "loaded", elapsed_s=round(elapsed_s, 1))
        elif name == "failed":
            self._add(slot, "load_failed", reason=reason, elapsed_s=round(elapsed_s, 1))
        else:  # a phase a later lifecycle tells (withdrawn): the load ended, nothing loaded
            self._add(slot, f"load_{name}", reason=reason, elapsed_s=round(elapsed_s, 1))

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        self._up.discard(slot)
        self._loading.discard(slot)
        self._add(slot, "unload", reason=str(reason), loaded_s=loaded_s)

    def swap(self, swap: Swap) -> None:
        self._add(swap.slot, "swap", phase=str(swap.phase), group=swap.group,
                  victim=swap.victim, reason=swap.why, waited_s=swap.waited_s)

    # A process that exited and was not started again
    def state_changed(self, slot: Slot, old: SlotState, new: SlotState, reason: str | None
                      ) -> None:
        if new in AT_REST and (slot.name in self._up or old is SlotState.ERROR):
            self._up.discard(slot.name)
            self._add(slot.name, "stopped", reason=reason, old=str(old))
        elif new is SlotState.ERROR and old is not SlotState.ERROR:
            self._add(slot.name, "error", reason=reason, old=str(old))
        elif old is SlotState.ERROR and new in UP:
            self._add(slot.name, "recovered")

    # -- reading -----------------------------------------------------------------------------

    def horizon(self, now: float) -> float:
        """The oldest moment the log can speak for."""
        return max(self.started, now - self.keep_s)

    def events(self, since: float) -> list[dict[str, Any]]:
        now = self.clock()
        start = max(since, now - self.keep_s)
        return [dict(event) for event in self._events if event["ts"] >= start]

    def spans(self, since: float, now_as: dict[str, str | None]) -> list[Span]:
        """Each slot's loading, loaded and error spans that reach into [since, now]; `now_as`:
        every slot's name, and what it is now (`loaded`: its process is up or starting,
        `error`, None: at rest), for a slot the kept events say nothing of."""
        now = self.clock()
        horizon = self.horizon(now)
        kept = [event for event in self._events if event["ts"] >= horizon]
        out: list[Span] = []
        for name, now_state in now_as.items():
            mine = [event for event in kept if event["slot"] == name]
            out.extend(span for span in _spans_of(name, mine, horizon, now_state)
                       if span.end is None or span.end >= since)
        return [Span(s.slot, s.state, max(s.start, since), s.end, s.outcome) for s in out]


# What a slot was before the first kept event of each kind: an unload or a stop means it was
# loaded until then, an answer again that it was in error, anything else but a load that it was
# loading (a load whose beginning is past the horizon). A stop or an error that says the state
# it left (`old`) is taken at its word.
_BEFORE: Final = {"unload": "loaded", "stopped": "loaded", "error": "loaded",
                  "recovered": "error", "load": None}
_SPAN_OF_STATE: Final = {"ready": "loaded", "serving": "loaded", "stopping": "loaded",
                         "starting": "loading", "error": "error"}


def _before(event: dict[str, Any]) -> str | None:
    if "old" in event:
        return _SPAN_OF_STATE.get(event["old"])
    return _BEFORE.get(event["kind"], "loading")


def _spans_of(name: str, events: Iterable[dict[str, Any]], horizon: float,
              now_state: str | None) -> list[Span]:
    events = [event for event in events if event["kind"] != "swap"]
    out: list[Span] = []
    open_state = _before(events[0]) if events else now_state
    open_at = horizon

    def close(at: float, outcome: str | None = None) -> None:
        nonlocal open_state
        if open_state is not None:
            out.append(Span(name, open_state, open_at, at,
                            outcome if open_state == "loading" else None))
        open_state = None

    for event in events:
        kind, at = event["kind"], event["ts"]
        if kind == "load":
            close(at, "restarted")
            open_state, open_at = "loading", at
        elif kind == "loaded":
            close(at, "loaded")
            open_state, open_at = "loaded", at
        elif kind.startswith("load_"):
            close(at, kind.removeprefix("load_"))
        elif kind in ("unload", "stopped"):
            close(at, "unloaded")
        elif kind == "error":
            close(at, "failed")
            open_state, open_at = "error", at
        elif kind == "recovered":
            close(at)
            open_state, open_at = "loaded", at
    if open_state is not None:
        out.append(Span(name, open_state, open_at, None))
    return out


class FreeMemory:
    """What each group's free_memory_command reported when last run, and when."""

    def __init__(self, every_s: float = FREE_MEMORY_EVERY_S) -> None:
        self.every_s = every_s
        self._last: dict[str, tuple[float, int | None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def read(self, group: GroupConfig) -> tuple[int | None, float | None]:
        """(free MiB, when it was read) or (None, None) for a group without the command."""
        if group.free_memory_command is None:
            return None, None
        lock = self._locks.setdefault(group.name, asyncio.Lock())
        async with lock:  # two pages at once run the command once
            last = self._last.get(group.name)
            if last is None or time.time() - last[0] >= self.every_s:
                last = (time.time(), await free_memory_mib(group))
                self._last[group.name] = last
        at, free = last
        return free, (at if free is not None else None)


@dataclass(eq=False)
class Timeline:
    """What GET /api/timeline reads beside the history: the log and the free memory."""

    log: LifecycleLog
    free_memory: FreeMemory
