"""Room on the devices, made: in a load's turn on the devices (one load at a time on the box, as
in a group), the devices are read afresh and device_room.py decides; this carries each decision
out (unloads, waits) and asks again, until the load goes (with its placement) or is refused.
Without devices to read nothing of this runs: no turn, no read, today's behaviour.

A slot in a group makes its group's room first (load_jobs.py): the group's limits and turns
stand, and the devices' room is made after, across every model on the box.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator
from typing import Final

from hal0d.devices.placement import Placement
from hal0d.devices.reading import Reading
from hal0d.lifecycle import device_room, room
from hal0d.lifecycle.device_room import (
    Crowded,
    EvictSet,
    Go,
    Holder,
    Load,
    Never,
    SettleDevices,
    WaitTurns,
)
from hal0d.lifecycle.groups import DEVICES_GROUP, Group
from hal0d.lifecycle.room import Member, NoRoom, Pricing, Withdrawn
from hal0d.lifecycle.runner import Runner
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.teller import Teller, log
from hal0d.lifecycle.vocabulary import LOADED, SwapPhase, UnloadReason

HOUR_S: Final = 3600.0


class DeviceJobs(Teller):
    """The room a load makes on the devices."""

    @contextlib.asynccontextmanager
    async def device_turn(self, slot: Slot) -> AsyncIterator[Group | None]:
        """The box's turn for `slot`'s load, where devices are read; None (no wait) where
        not."""
        if self.devices is None or not self.devices.reads():
            yield None
            return
        turn = self.on_devices
        await turn.take_turn(slot)
        try:
            yield turn
        finally:
            turn.pending = None
            turn.give_turn()

    async def device_room(self, turn: Group, runner: Runner, *, urgent: bool,
                          failed: str | None) -> tuple[Placement | None, float | None]:
        """Room on the devices for `runner`'s load, made in the box's turn: where it goes, and
        when its first victim began to go (None: nothing was unloaded for it). NoRoom when the
        load can never fit, or fits nowhere by a measured footprint with nothing to unload;
        Withdrawn when nobody waits for it any more."""
        assert self.devices is not None
        config, me = runner.config, runner.slot
        load = Load(config.name, self.memory_of(config), self.footprints.devices_of(config),
                    config.devices, may_evict=failed is None)
        began: float | None = None
        waited_since = time.monotonic()
        told: tuple[str, ...] = ()
        while True:
            reading = await self.devices.read()
            now = time.monotonic()
            decision = device_room.decide(load, reading, self.devices.margins(),
                                          self._holders(reading, me, urgent, now), now)
            if isinstance(decision, Go):
                return decision.placement, began
            if isinstance(decision, Never):
                raise NoRoom(decision.why)
            if isinstance(decision, Crowded):
                if self.footprints.learned_mib(config) is None or decision.fallback is None:
                    log.info("slot.placed_anyway", slot=config.name, why=decision.why)
                    return decision.fallback, began
                raise NoRoom(f"no room on the devices: {decision.why}")
            if isinstance(decision, SettleDevices):
                await self._settled(decision.slot)
            elif isinstance(decision, EvictSet):
                began = began or now
                await self._evict_set(turn, me, decision)
            else:
                assert isinstance(decision, WaitTurns)
                if now - waited_since > config.load_timeout_s:
                    raise NoRoom(f"no room on the devices within load_timeout_s "
                                 f"({config.load_timeout_s:g} s): {decision.why}")
                if not urgent and me.oldest_waiting_since() is None and not me.in_flight:
                    raise Withdrawn(f"no request waits for slot {me.name!r} any more")
                if decision.victims != told:
                    told = decision.victims
                    log.info("slot.waiting_for_room", slot=me.name, victims=list(told),
                             in_s=round(max(0.0, decision.until - now), 1), why=decision.why)
                await turn.until(decision.until)

    async def _evict_set(self, turn: Group, me: Slot, decision: EvictSet) -> None:
        for victim in decision.victims:
            member = victim.member
            self._tell_swap(turn, SwapPhase.PLANNED, me, member, decision.why)
            self._tell_swap(turn, SwapPhase.STARTED, me, member, decision.why)
            log.info("slot.evicting", slot=member.slot.name, group=DEVICES_GROUP,
                     **{"for": me.name}, in_flight=member.slot.in_flight,
                     queued=member.slot.queued, why=decision.why,
                     held_mib={str(index): mib for index, mib in victim.held.items()},
                     cost=round(victim.cost, 3))
        for victim in decision.victims:
            await self.unload(victim.member.slot.name, UnloadReason.EVICTED)
        for victim in decision.victims:
            self._tell_swap(turn, SwapPhase.DONE, me, victim.member, "room made")

    def _holders(self, reading: Reading, me: Slot, urgent: bool, now: float) -> list[Holder]:
        """The slots' models holding memory on the devices by this read, `me` aside."""
        held: dict[str, dict[int, int]] = {}
        for device in reading.devices:
            for name, mib in device.held_by_slots().items():
                held.setdefault(name, {})[device.index] = mib
        holders = []
        for name, by_device in held.items():
            runner = self.runners.get(name)
            if name == me.name or runner is None or runner.slot.state not in LOADED:
                continue
            member = self.member_of(name)
            if member is None:
                continue
            load_s = runner.load_s or self.on_devices.pricing().swap_s(None)
            cost = device_room.reload_cost(load_s, runner.uses_since(now - HOUR_S),
                                           now - runner.last_used)
            holders.append(Holder(member, by_device, cost,
                                  self._may_go_at(member, me, urgent, now)))
        return holders

    def _may_go_at(self, member: Member, me: Slot, urgent: bool, now: float) -> float | None:
        """When a model may be unloaded for `me`: at once when idle (a gap between two of a
        client's requests aside) or when the load is urgent (its requests in flight finish
        first); by the classes (room.held_for_interactive, room.preempts); with work, once its
        turn is over (its group's pricing, else the box's)."""
        if urgent:
            return None
        if (held := room.held_for_interactive(me, member.slot, now)) is not None:
            return held
        if room.preempts(me, member.slot, now):
            return None
        if not room.busy(member.slot):
            grace = member.last_used + room.IDLE_GRACE_S
            return None if now >= grace else grace
        group = self.groups.get(self.configs[member.slot.name].group)
        pricing: Pricing = (group or self.on_devices).pricing()
        deadline = room.turn_over(pricing, me.oldest_waiting_since() or now, member)
        return None if now >= deadline else deadline
