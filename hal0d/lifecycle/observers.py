"""Who is told what the lifecycle does, through one subscription.

An observer (the event feed, the timeline, the metrics, the route's cooldowns) subscribes once,
with `LifecycleManager.subscribe`, and is told every slot there is at once (`slot_added`), so
the order in which the app's parts are set up does not matter; afterwards each slot a reload
adds or changes, each state change and change of counts (every slot's own, told by admission
and the manager alike), and each load phase, unload and swap step the manager's jobs tell.

The manager's own reactions to a slot's state and counts (its idle timer, its group's wait) are
told first, then the `slot.state_changed` log line, then the subscribers in the order they
came, each shielded from another's failure: a broken observer must not wedge admission halfway
through a grant or a release.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from hal0d.lifecycle.room import Swap
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import LoadPhase, SlotState, UnloadReason
from hal0d.logs import get_logger

log = get_logger()


class LifecycleObserver:
    """What a subscriber may be told; each a no-op here, for a subscriber to override what it
    needs."""

    def slot_added(self, slot: Slot) -> None:
        """A slot there is: at subscribe, every slot of the table; later, each a reload adds."""

    def slot_reconfigured(self, slot: Slot) -> None:
        """A reload changed the slot's config (its view has the new one)."""

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None:
        """The slot stepped from `old` to `new` (machine.py's table)."""

    def counts_changed(self, slot: Slot) -> None:
        """Its in_flight or queued changed."""

    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        """A load's phase; repeated every LOAD_TICK_S while it lasts."""

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        """A process of the slot's is gone (an unload, an eviction, a shutdown)."""

    def swap(self, swap: Swap) -> None:
        """A step of a swap in a group: planned, started (the victim drains), done."""


class SlotReactions(Protocol):
    """The manager's own reactions to a slot, told before any subscriber."""

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None: ...

    def counts_changed(self, slot: Slot) -> None: ...


def log_state_change(slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
    if new == SlotState.SERVING or (old == SlotState.SERVING and new == SlotState.READY):
        return  # every lease would log twice; in_flight is in /api/slots and /metrics instead
    level = log.warning if new == SlotState.ERROR else log.info
    level("slot.state_changed", slot=slot.name, old=str(old), new=str(new), reason=reason)


class Observers(LifecycleObserver):
    """Every subscriber, told in turn; what each slot tells (Slot.observer) and what the
    manager's jobs tell."""

    def __init__(self, own: SlotReactions) -> None:
        self.own = own
        self.subscribers: list[LifecycleObserver] = []
        # Of them, those that listen to each state change and each change of counts: a request
        # changes both a few times, so the ones that would do nothing are not called at all.
        self._state_listeners: list[LifecycleObserver] = []
        self._count_listeners: list[LifecycleObserver] = []

    def subscribe(self, observer: LifecycleObserver, slots: Iterable[Slot]) -> None:
        self.subscribers.append(observer)
        kind = type(observer)
        if kind.state_changed is not LifecycleObserver.state_changed:
            self._state_listeners.append(observer)
        if kind.counts_changed is not LifecycleObserver.counts_changed:
            self._count_listeners.append(observer)
        for slot in slots:
            observer.slot_added(slot)

    def _each(self, what: str, *args: object) -> None:
        for observer in self.subscribers:
            try:
                getattr(observer, what)(*args)
            except Exception:
                log.exception("lifecycle.observer_failed", observer=type(observer).__name__,
                              told=what)

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None:
        try:
            self.own.state_changed(slot, old, new, reason)
        except Exception:
            log.exception("slot.listener_failed", slot=slot.name, old=old, new=new)
        log_state_change(slot, old, new, reason)
        for observer in self._state_listeners:  # twice a request: no lookup by name here
            try:
                observer.state_changed(slot, old, new, reason)
            except Exception:
                log.exception("lifecycle.observer_failed", observer=type(observer).__name__,
                              told="state_changed")

    def counts_changed(self, slot: Slot) -> None:
        self.own.counts_changed(slot)
        for observer in self._count_listeners:
            observer.counts_changed(slot)

    def slot_added(self, slot: Slot) -> None:
        self._each("slot_added", slot)

    def slot_reconfigured(self, slot: Slot) -> None:
        self._each("slot_reconfigured", slot)

    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        self._each("load_phase", slot, phase, elapsed_s, reason)

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        self._each("unloaded", slot, reason, loaded_s)

    def swap(self, swap: Swap) -> None:
        self._each("swap", swap)
