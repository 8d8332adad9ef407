"""A reload, slot by slot: what a config diff (ConfigDiff) asks of each slot's lifecycle.

The lifecycle manager applies the diff (`LifecycleManager.apply`) and stays the one writer of
slot transitions: it carries each slot's step out. This module keeps the diff's books in the
state it is handed (the table, the configs, a runner's successor), decides each changed slot's
`Step`, and runs the one task a reload has of its own (`retire`). In order:

    added     joins the table (told of its changes as the first slots are), then rests (on
              demand), starts (always) or is probed (no command) before `apply` returns
    removed   goes offline (its queued requests get a 503) and leaves the table; its process
              stops once its leases are released (`retire`, for at most the drain's bound)
    changed   takes its new limits at once (leases held keep counting), then the `Step` below

A changed slot whose command, upstream and start are the same keeps its process. One whose
process changed never has a request cut: it is unloaded (what is in flight drains on the old
settings, for at most the drain's bound, while new requests queue), and once the old process is
gone it takes on its new config: an `always` one starts again at once, an on-demand one on its
next request.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable
from dataclasses import dataclass

from hal0d.config import GroupConfig, SlotConfig
from hal0d.lifecycle.machine import Event, allows
from hal0d.lifecycle.runner import Runner, drain
from hal0d.lifecycle.slots import Slot, SlotObserver
from hal0d.lifecycle.table import SlotTable
from hal0d.lifecycle.teller import Teller
from hal0d.lifecycle.vocabulary import SlotState, UnloadReason


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


class Step(enum.StrEnum):
    """What a changed config asks of its slot, by what the slot has and where it is."""

    KEEP = "keep"  # a probed upstream that stays one: its limits were all that changed
    ADOPT = "adopt"  # a probed upstream that hal0d now starts itself: started, or at rest
    RECONFIGURE = "reconfigure"  # the same process: a changed idle wait applies to the one running
    TAKE_ON = "take_on"  # no process, nothing under way: the new config at once, loaded if wanted
    WITHDRAW = "withdraw"  # a load waiting for its group's room: cancelled; then as TAKE_ON
    RESTART = "restart"  # exited, waiting out its backoff: the restart is the new config's
    REPLACE = "replace"  # an `always` slot's new process: `starting` at once, the old one drains
    UNLOAD = "unload"  # the old process drains and stops; then the new config is taken on


def change(table: SlotTable, configs: dict[str, SlotConfig], runner: Runner | None,
           after: SlotConfig, drain_s: float) -> Step:
    """A changed config kept: the slot takes its limits and view at once, a runner whose
    process stays takes the whole config, and a runner whose step waits for its old process to
    go keeps `after` as its successor, with the drain's bound. Returns the step."""
    name = after.name
    taken = step(configs[name], after, runner)
    table[name].reconfigure(after)  # limits and the view; leases held keep counting
    configs[name] = after
    if runner is None:
        return taken
    if taken is Step.RECONFIGURE:
        runner.take_on(after)
    elif taken is not Step.TAKE_ON:  # taken on once the old process is gone
        runner.succeed_by(after, drain_s)
    return taken


def step(before: SlotConfig, after: SlotConfig, runner: Runner | None) -> Step:
    """The step a slot takes from `before` to `after`; `runner` is its own, None for a slot
    hal0d only probes."""
    if runner is None:
        return Step.ADOPT if after.command else Step.KEEP
    if (before.command, before.upstream, before.start) == (after.command, after.upstream,
                                                           after.start):
        return Step.RECONFIGURE
    state = runner.slot.state
    if state is SlotState.STOPPED:
        return Step.WITHDRAW if runner.busy else Step.TAKE_ON
    if state is SlotState.ERROR and runner.child is None and not runner.busy:
        return Step.RESTART
    if after.command and not after.on_demand:
        return Step.REPLACE
    return Step.UNLOAD


def added_slot(table: SlotTable, config: SlotConfig, observer: SlotObserver) -> Slot:
    """A slot the reload adds, in the table, telling its changes to `observer` as the first
    slots do (the manager's observers)."""
    slot = Slot(config, observer=observer, book=table.book)
    table.add(slot)
    return slot


async def retire(runner: Runner, drain_s: float) -> None:
    """A removed slot's process, stopped once its leases are released (or `drain_s` passed);
    the start it may have been in is cancelled first."""
    job = runner.job
    if job is not None and not job.done():
        job.cancel()
        await asyncio.wait({job})
    try:
        await drain(runner.slot, drain_s)
    finally:
        await runner.stop_child()


class Reloads(Teller):
    """A reload carried out by the manager: each slot's step, its successor taken on."""

    async def apply(self, diff: ConfigDiff, *, drain_s: float = 900.0) -> None:
        """A reload (reload.py: what it asks of each slot). New slots join the table and are
        probed (or started) before this returns; everything after that await runs in one step,
        and the caller swaps the Runtime right after, so no request is ever routed to a slot
        missing from the table. What drains (a removed slot's leases, the streams of a process
        that changed) drains for at most `drain_s`."""
        self.groups.replace(diff.groups)
        plain: list[str] = []
        for config in diff.added:
            slot = added_slot(self.table, config, self.observers)
            adopted = self._adopt(config)
            self.observers.slot_added(slot)
            if adopted is None:
                plain.append(config.name)
            else:
                self._begin(adopted)
        await asyncio.gather(*(self.probe_once(name) for name in plain))
        for name in diff.removed:
            self._remove(name, drain_s)
        for config in diff.changed:
            self._change(config, drain_s)
            self.observers.slot_reconfigured(self.table[config.name])
        for runner in self.runners.values():  # the groups' members as the reload left them
            self._wire(runner)
        self.sweep_caches()

    def _remove(self, name: str, drain_s: float) -> None:
        slot = self.table.remove(name)
        del self.configs[name]
        self._step(slot, Event.SHUTDOWN)
        runner = self.runners.pop(name, None)
        if runner is not None:
            runner.cancel_timers()
            runner.cold()
            self._spawn(retire(runner, drain_s))

    def _change(self, after: SlotConfig, drain_s: float) -> None:
        name, runner = after.name, self.runners.get(after.name)
        idle_before = runner.idle_unload_s() if runner is not None else None
        step = change(self.table, self.configs, runner, after, drain_s)
        if step is Step.ADOPT and (adopted := self._adopt(after)) is not None:
            self._begin(adopted)
        if runner is None:  # its state and reason were its old upstream's: asked anew now
            self._spawn(self.probe_once(name))
            return
        if step is Step.RECONFIGURE:
            if runner.idle_unload_s() != idle_before and runner.slot.state is SlotState.READY:
                runner.arm_idle(self._idle, from_last_use=True)
        elif step is Step.TAKE_ON:
            self._take_on(runner, after)
            if self.runners.get(name) is runner and runner.wanted():
                self._start_if_resting(runner)
        elif step is Step.WITHDRAW:
            self._unload_now(runner, UnloadReason.RELOAD)  # cancels the load that waits
            self._spawn(self._after_withdrawn(runner))
        elif step is Step.RESTART:
            runner.cancel_timers()
            self._take_on(runner, after)
            if self.runners.get(name) is runner:
                if runner.wanted():
                    self.tell(runner, Event.START)
                elif not runner.slot.in_flight:
                    self.tell(runner, Event.REST, "reloaded: loads on the next request")
        elif step is Step.REPLACE:
            if allows(runner.slot.state, Event.REPLACE):
                # `starting` at once (new requests wait for the new process) while the old one
                # drains and stops; a slot already stopping takes its successor on when its
                # process is gone.
                runner.unload_for(UnloadReason.RELOAD)
                self.tell(runner, Event.REPLACE, "replacing its process (reload)")
        else:
            self._unload_now(runner, UnloadReason.RELOAD)

    async def _after_withdrawn(self, runner: Runner) -> None:
        """A load a reload cancelled while it waited for room: once ended, as after an unload."""
        if runner.job is not None:
            await asyncio.wait({runner.job})
        if runner.slot.state is SlotState.STOPPED:
            self._unloaded(runner)

    def _take_on(self, runner: Runner, after: SlotConfig) -> None:
        """A reload's config for a runner whose process is gone."""
        if not after.command:  # now an upstream hal0d only probes
            del self.runners[runner.name]
            self._unwire(runner.slot)
            self._spawn(self.probe_once(runner.name))
            return
        runner.take_on(after)
        self._wire(runner)
        self.sweep_caches()  # the old command's caches, now that its process is gone

    def _unloaded(self, runner: Runner) -> None:
        """The process is gone: a reload's new config is taken on; started again if wanted."""
        runner.unloaded()
        if runner.successor is not None:
            self._take_on(runner, runner.successor)
        if self.runners.get(runner.name) is runner and runner.wanted():
            self._start_if_resting(runner)
