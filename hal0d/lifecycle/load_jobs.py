"""The lifecycle manager's jobs: a load, one task from the group's turn to the process admitted
(room made, launch, probe, the saved caches restored), and a stop (the start it interrupts
cancelled and awaited, the drain, the save, the process stopped). Each reports its outcome with
the generation it was started for (Teller.report).

Room is made in the load's turn by carrying out what room.py decides from a snapshot of the
group: settle (wait for a member's job), evict (unload a victim; with batch, once its turn is
over), or refuse (NoRoom). Nothing in room.py or groups.py calls back into the manager.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from hal0d.devices.placement import Placement
from hal0d.lifecycle import room
from hal0d.lifecycle.device_jobs import DeviceJobs
from hal0d.lifecycle.groups import Group, free_memory_mib
from hal0d.lifecycle.machine import Event, allows
from hal0d.lifecycle.process import Child, launch_problem
from hal0d.lifecycle.room import Member, NoRoom, Room, Settle, Withdrawn
from hal0d.lifecycle.runner import Progress, Runner
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.teller import log
from hal0d.lifecycle.vocabulary import (
    EVICTABLE,
    LoadPhase,
    Started,
    SwapPhase,
    UnloadReason,
)


@dataclass(frozen=True, slots=True)
class RoomMade:
    """What a load's room making did: when its first victim began to go, in whose turn (the
    group's or the box's: whose swap it is), and where the load goes."""

    began: float | None = None
    swapped: Group | None = None
    placement: Placement | None = None

    def then(self, later: RoomMade) -> RoomMade:
        """This, then `later` (a second round: the box's after the group's, a retry's)."""
        return RoomMade(self.began or later.began, self.swapped or later.swapped,
                        later.placement)

    def placed(self, slot: str) -> Placement | None:
        if self.placement is not None:
            log.info("slot.placed", slot=slot, devices=list(self.placement.devices),
                     why=self.placement.why)
        return self.placement


class LoadJobs(DeviceJobs):
    """The manager's load and stop jobs, and the room a load makes."""

    def _bring_up(self, runner: Runner) -> None:
        runner.new_load()
        runner.job_generation += 1
        runner.job = self._spawn(self._start(runner, runner.job_generation))

    async def _start(self, runner: Runner, generation: int) -> None:
        """A load's one job, up to its outcome: the group's turn with room made, then in that
        turn the launch, the probe and the restore (Runner.bring_up), so nothing else of the
        group loads, and no room is counted, while it restores. `launch` is told once the turn
        is had; the outcome as `answered`, `no_room`, `start_failed` or `load_failed`, in the
        same step as the job is over (`job` None): what the outcome's actions start is a job of
        its own. A stop cancels it whole: it then tells nothing."""
        slot = runner.slot
        progress = Progress(self.tell_phase, runner.name)
        log.info("slot.load_started", slot=runner.name, queued=slot.queued)
        try:
            started = await runner.ended(await self._load(runner, generation, progress),
                                         progress)
        except Withdrawn as exc:
            log.info("slot.load_withdrawn", slot=runner.name, reason=str(exc))
            self.tell_phase(runner.name, LoadPhase.WITHDRAWN, progress.elapsed(), str(exc))
            started = Started.WITHDRAWN
        except NoRoom as exc:
            # Not the model's failure: no backoff, and the next request may find room.
            runner.no_room(str(exc))
            log.info("slot.no_room", slot=runner.name, reason=runner.cause)
            progress.enter(LoadPhase.FAILED, runner.cause)
            started = Started.NO_ROOM
        except Exception as exc:  # a bug of hal0d's: the load fails rather than wedge the slot
            log.error("lifecycle.task_failed", task="start", slot=runner.name,
                      error=repr(exc), exc_info=exc)
            await runner.stop_child()
            runner.failed(f"hal0d failed to load it ({exc!r})", 0.0, None)
            started = Started.FAILED
        finally:
            progress.stop()
            slot.turn_wait(False)
        if generation != runner.job_generation:
            return  # superseded while it ended: its outcome is not the slot's any more
        runner.job = None
        if started is Started.WITHDRAWN:
            if runner.wanted():
                self._start_if_resting(runner)  # a request came back in the same instant
        elif started is Started.ANSWERED:
            assert runner.child is not None
            self.refresh_bounds(runner.config.group)  # its group's wait bounds learn this load
            runner.watched_by(self._spawn(self._watch(runner, runner.child)))
            self.report(runner, generation, Event.ANSWERED)
        elif started is Started.NO_ROOM and not slot.in_flight:
            self.report(runner, generation, Event.NO_ROOM, runner.cause)
        elif runner.config.on_demand and not slot.in_flight and started is Started.FAILED:
            self.report(runner, generation, Event.LOAD_FAILED, f"load failed: {runner.cause}")
        else:
            if started is Started.NO_ROOM:  # restarting under leases in flight: retried later
                runner.take_backoff()
            # An `always` slot's start, or the restart that requests in flight waited for (their
            # connect was refused as the process died): retried after the backoff while wanted.
            # Before the state is ERROR (where leases are granted): nothing of ours listens.
            slot.refuse_loads(runner.cause or "unknown", runner.retry_in_s)
            self.report(runner, generation, Event.START_FAILED,
                        f"{runner.cause}; retrying in {runner.retry_in_s:g} s")

    async def _load(self, runner: Runner, generation: int, progress: Progress) -> str | None:
        """The group's turn and the box's, room made in them, then the process brought up in
        them: None once it answers with its caches back, else why not. Withdrawn, NoRoom: as
        room.py and device_room.py say."""
        slot, config = runner.slot, runner.config
        urgent = runner.take_urgent()
        # An `always` slot starts even when no room can be made: the config check made sure the
        # group's `always` slots fit together. An urgent load (pinned, or asked for by the API)
        # waits for no batch; a model whose last load failed unloads no other for a load likely
        # to fail again, unless an operator asks.
        pinned = not config.on_demand
        failed = None if pinned or urgent else runner.load_error
        if self.groups.get(config.group) is not None or (
                self.devices is not None and self.devices.reads()):
            if (problem := launch_problem(config.command or ())) is not None:
                return runner.cannot_launch(problem)
            progress.enter(LoadPhase.WAITING_FOR_ROOM)
            slot.turn_wait(True)
        async with self.groups.turn(slot, config.group) as group, \
                self.device_turn(slot) as box:
            made = await self._room(group, box, runner, urgent=urgent or pinned, failed=failed)
            slot.turn_wait(False)
            # A new run of the slot's process: what was learnt of the last one is asked anew.
            slot.generation += 1
            self.report(runner, generation, Event.LAUNCH, runner.launch_words())
            cause = await runner.bring_up(self.client, progress, made.placed(config.name))
            if cause is not None and (oom := runner.out_of_memory()) is not None:
                # Out of memory: its footprint raised to what it asked, room made for that in
                # the same turn, one more try. Only a second failure is its waiters' 503.
                need = self.footprints.raise_to(config, round(oom.asked_mib or 0), oom.device)
                log.warning("slot.load_retrying", slot=config.name, reason=str(oom),
                            need_mib=need)
                await runner.stop_child()
                try:
                    again = await self._room(group, box, runner, urgent=True, failed=None)
                except NoRoom as exc:  # launched once already: the load failed, for memory
                    return f"{oom}; {exc}"
                made = made.then(again)
                cause = await runner.bring_up(self.client, progress, made.placed(config.name))
            if cause is None and made.swapped is not None:
                self._swapped(made.swapped, slot, made.began or time.monotonic())
            return cause

    async def _room(self, group: Group | None, box: Group | None, runner: Runner, *,
                    urgent: bool, failed: str | None) -> RoomMade:
        """Room in the load's group, then on the devices: what was unloaded for it and where it
        goes. An `always` slot's load goes on when none can be made."""
        made = RoomMade()
        try:
            if group is not None and (began := await self._make_room(
                    group, runner, urgent=urgent, failed=failed)) is not None:
                made = RoomMade(began, group)
            if box is not None:
                placement, began = await self.device_room(box, runner, urgent=urgent,
                                                          failed=failed)
                made = made.then(RoomMade(began, box if began is not None else None, placement))
        except NoRoom:
            if runner.config.on_demand:
                raise
        return made

    def _swapped(self, group: Group, slot: Slot, began: float) -> None:
        """A swap is over once its model answers with its caches back: what it cost, logged,
        and the group's wait bounds priced anew."""
        clock = group.clock
        cost_s = clock.swapped(began, time.monotonic())
        log.info("group.swap_measured", group=group.config.name, slot=slot.name,
                 cost_s=round(cost_s, 3), median_s=clock.cost_s(),
                 share=clock.share(time.monotonic()),
                 turn_s=round(group.pricing().turn_s(None), 1))
        self.refresh_bounds(None if group is self.on_devices else group.config.name)

    # -- room in the load's turn (room.py decides, this carries it out) -----------------------

    async def _make_room(self, group: Group, runner: Runner, *, urgent: bool,
                         failed: str | None) -> float | None:
        """Room for `runner`'s load in `group`, made in its turn: room.decide asked again after
        each step it asks for; returns when its first victim began to go (monotonic), None
        when nothing was unloaded for it. NoRoom when none can be made; Withdrawn when
        nobody waits for the load any more."""
        limits, me, config = group.config, runner.slot, runner.config
        need = self.memory_of(config)
        swapped: Member | None = None
        began: float | None = None
        planned = False
        while True:
            occupying = [m for m in self._members(limits.name)
                         if m.slot.name != config.name and m.occupies()]
            short = room.shortfall(limits, occupying, need)
            if short is None and limits.free_memory_command is not None:
                free = await free_memory_mib(limits)
                if free is not None and free < need:
                    short = f"{free} MiB free by free_memory_command, {need} MiB needed"
            try:
                decision = room.decide(limits, config.name, occupying, short, failed=failed)
            except NoRoom:
                if failed is not None and (victim := room.choose_victim(occupying, limits)):
                    log.info("slot.not_evicting", slot=victim.slot.name, group=limits.name,
                             **{"for": config.name}, reason=failed)
                raise
            if isinstance(decision, Room):
                if swapped is not None:
                    self._tell_swap(group, SwapPhase.DONE, me, swapped, "room made")
                return began
            if isinstance(decision, Settle):
                await self._settled(decision.slot)
                continue
            victim, pricing = decision.victim, group.pricing()
            if not urgent:
                wake = room.not_yet(pricing, me, victim, time.monotonic())
                if wake is not None:
                    pending = group.pending = room.pending(pricing, me, victim, time.monotonic())
                    if not planned:
                        planned = True
                        self._tell_swap(group, SwapPhase.PLANNED, me, victim,
                                        room.planned_why(pricing, me, victim, pending.turn_at_s,
                                                         time.monotonic()))
                    await self._wait_turn(group, me, victim.slot.name, wake)
                    continue
                group.pending = None
            why = decision.short + (room.batch_why(pricing, me, victim, time.monotonic())
                                    if not urgent else "")
            await self._evict(group, me, victim, why, planned=planned)
            # The swap's cost begins where its first victim's requests in flight were done:
            # until then they were served, not lost.
            runner_gone = self.runners.get(victim.slot.name)
            began = began or (runner_gone.drained_at if runner_gone else None) or time.monotonic()
            swapped = victim

    async def _evict(self, group: Group, me: Slot, victim: Member, why: str, *,
                     planned: bool) -> None:
        limits = group.config
        if not planned:
            self._tell_swap(group, SwapPhase.PLANNED, me, victim, why)
        self._tell_swap(group, SwapPhase.STARTED, me, victim, why)
        log.info("slot.evicting", slot=victim.slot.name, group=limits.name,
                 **{"for": me.name}, in_flight=victim.slot.in_flight,
                 queued=victim.slot.queued, why=why)
        await self.unload(victim.slot.name, UnloadReason.EVICTED)

    async def _wait_turn(self, group: Group, me: Slot, victim: str, wake: float) -> None:
        """Until `victim` is to go for `me` (or is no longer evictable): the batch's end. Only
        the batch rule is looked at again on each wake (a busy victim's counts change with every
        request); the room, free_memory_command's included, once the wait is over."""
        limits = group.config
        next_wake: float | None = wake
        while next_wake is not None:
            await group.until(next_wake)
            self.regrant(limits.name)  # a victim's batch work past its bound is urgent now
            member = next((m for m in self._members(limits.name) if m.slot.name == victim), None)
            if member is None or member.slot.state not in EVICTABLE:
                return
            now, pricing = time.monotonic(), group.pricing()
            next_wake = room.not_yet(pricing, me, member, now)
            if next_wake is not None:
                group.pending = room.pending(pricing, me, member, now)

    async def _watch(self, runner: Runner, child: Child) -> None:
        """A process that exits on its own (not stopped by hal0d) is told as `exited`."""
        code = await child.wait()
        if runner.child is not child or self._stopping:
            return  # a stop ended it
        cause = runner.exited(child, code)
        if allows(runner.slot.state, Event.EXITED):
            self.tell(runner, Event.EXITED, cause)

    # -- stops ---------------------------------------------------------------------------------

    def _stop_process(self, runner: Runner) -> None:
        cancelled, runner.job = runner.job, None
        runner.job_generation += 1
        runner.job = self._spawn(self._stop(runner, cancelled, runner.job_generation))

    async def _stop(self, runner: Runner, start: asyncio.Task[None] | None,
                    generation: int) -> None:
        """An unload's (or a replace's) own task (Runner.wind_down): the start it interrupts
        cancelled and awaited, its restore too, before the process stops; told as `gone`."""
        reason = runner.unloading
        try:
            await runner.wind_down(start, self.observers, self.client)
        except Exception as exc:  # a bug of hal0d's: the process still goes, the slot with it
            log.error("lifecycle.task_failed", task="stop", slot=runner.name,
                      error=repr(exc), exc_info=exc)
            await runner.stop_child()
        if generation != runner.job_generation:
            return
        runner.job = None  # done: a start that `gone` leads to is a job of its own
        self.report(runner, generation, Event.GONE, f"unloaded ({reason})")
