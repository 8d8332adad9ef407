"""Placement: the order in which a route's slots are tried for one request, and what a client
is shown of a slot's state.

    1. a slot that does not answer (its probe found it in error, or it cools down after a
       request it did not answer: cooldown.py) goes after the ones that do
    2. prefer_loaded: a slot whose model is loaded (or needs no load) before one that must load
    3. in a route that spreads its work (spill_when_busy or prefer_loaded): the slot that served
       the conversation's last turn (conversations.py) while it has a free place, or none of
       the others has one: a busy warm slot is never waited for while another is free
    4. the configured order

A route that is only a failover order (neither key) keeps its order but for rule 1: its first
slot is the preferred one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from hal0d.conversations import Affinity
from hal0d.forward.cooldown import Cooldowns
from hal0d.lifecycle.machine import SlotState
from hal0d.lifecycle.remote import KIND_HAL0D, RemoteModels
from hal0d.lifecycle.table import SlotTable
from hal0d.routing import Plan, Route

# A slot in these states answers without a load.
_WARM: Final = frozenset({SlotState.READY, SlotState.SERVING, SlotState.STARTING})


@dataclass(frozen=True, slots=True)
class Placement:
    slots: SlotTable
    # What other hal0d boxes (slots of kind "hal0d") report loaded.
    remote: RemoteModels | None = None
    # The slot that last served each conversation.
    affinity: Affinity = field(default_factory=Affinity)
    # The route members that did not answer a request lately.
    cooldowns: Cooldowns = field(default_factory=Cooldowns)

    def order(self, plan: Plan, conversation: str | None = None) -> tuple[Route, ...]:
        """The plan's slots in the order they are tried (the module's docstring)."""
        route = plan.route
        if route is None:
            return plan.routes
        held = None
        if route.spill_when_busy or route.prefer_loaded:
            held = self.affinity.slot_for(conversation)
            if held is not None and not self._free(held) and any(
                    self._free(r.slot.name) for r in plan.routes):
                held = None
        return tuple(sorted(plan.routes, key=lambda r: (
            self._not_answering(r.slot.name), route.prefer_loaded and not self.warm(r),
            r.slot.name != held)))

    def _free(self, name: str) -> bool:
        slot = self.slots.get(name)
        return slot is not None and not slot.queued and slot.in_flight < slot.config.max_concurrent

    def _not_answering(self, name: str) -> bool:
        slot = self.slots.get(name)
        return self.cooldowns.cooling(name) or (slot is not None
                                                and slot.state is SlotState.ERROR)

    def warm(self, route: Route) -> bool:
        """Whether the slot answers without a load: its process is up or coming up, it has none
        to do (no on-demand command), or, another hal0d, that one reports the model so."""
        slot = route.slot
        if slot.kind == KIND_HAL0D:
            state = self.remote.state(slot.name, route.served_model) if self.remote else None
            return state is not None and state in _WARM
        live = self.slots.get(slot.name)
        return not slot.on_demand or (live is not None and live.state in _WARM)

    def state_of(self, route: Route) -> str:
        """The state a client is shown for a route's slot: another hal0d's report of the model
        when known, else the slot's own (offline when the table does not have it)."""
        if self.remote is not None and (
                remote := self.remote.state(route.slot.name, route.served_model)) is not None:
            return remote
        live = self.slots.get(route.slot.name)
        return str(live.state) if live is not None else "offline"
