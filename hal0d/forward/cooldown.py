"""Route members that stopped answering: tried after the others for a while, so only the first
request after a box died waits for it.

A slot of a route that handed a request on because it did not answer (no connection, a refused
one, a timeout, no first byte within `first_byte_timeout_s`) cools down: for COOLDOWN_FIRST_S,
doubling while it keeps failing up to COOLDOWN_MAX_S, the route's plan puts it after the slots
that answer (forward/path.py, Dispatch.order). It is back at once when a request it is given
answers, or when the lifecycle's probe finds it answering again (its state leaves `error`). The
log says it twice: one warning when it starts failing, one when it recovers; each hand-on in
between is an info line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final

from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import UP, SlotState
from hal0d.logs import get_logger

log = get_logger()

COOLDOWN_FIRST_S: Final = 10.0
COOLDOWN_MAX_S: Final = 300.0
# The hand-on reasons that say the slot does not answer at all (not a busy or a loading one).
NOT_ANSWERING: Final = frozenset({"first_byte_timeout", "connect_refused", "connect_failed",
                                  "timeout", "disconnected", "unavailable"})


@dataclass
class _Failing:
    since: float  # monotonic: its first failure in this run of failures
    until: float  # monotonic: tried after the others until then
    cooldown_s: float
    failures: int
    reason: str


class Cooldowns(LifecycleObserver):
    """The route members that did not answer, and until when each goes last."""

    def __init__(self) -> None:
        self._failing: dict[str, _Failing] = {}

    def cooling(self, slot: str) -> bool:
        failing = self._failing.get(slot)
        return failing is not None and time.monotonic() < failing.until

    def handed_on(self, slot: str, reason: str) -> None:
        """`slot` handed a request on for `reason`: a slot that does not answer cools down
        (the first time, said with a warning), for longer each time it fails again."""
        if reason not in NOT_ANSWERING:
            return
        now = time.monotonic()
        failing = self._failing.get(slot)
        if failing is None:
            self._failing[slot] = _Failing(now, now + COOLDOWN_FIRST_S, COOLDOWN_FIRST_S, 1,
                                           reason)
            log.warning("route.slot_failing", slot=slot, reason=reason,
                        cooldown_s=COOLDOWN_FIRST_S)
            return
        failing.cooldown_s = min(failing.cooldown_s * 2, COOLDOWN_MAX_S)
        failing.until, failing.reason = now + failing.cooldown_s, reason
        failing.failures += 1

    def answered(self, slot: str, how: str = "answered a request") -> None:
        """`slot` answers again: back in its place in the plan at once."""
        failing = self._failing.pop(slot, None)
        if failing is not None:
            log.warning("route.slot_recovered", slot=slot, how=how, failures=failing.failures,
                        failing_s=round(time.monotonic() - failing.since, 1))

    def slot_reconfigured(self, slot: Slot) -> None:
        """A reload changed the slot: what its old upstream did says nothing of the new one."""
        self._failing.pop(slot.name, None)

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None:
        """The probe found a failing slot answering again."""
        if new in UP and old is SlotState.ERROR and slot.name in self._failing:
            self.answered(slot.name, "its probe answered")
