"""A reload, slot by slot: what a config diff (runner.ConfigDiff) asks of each slot's lifecycle.

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

from hal0d.config import SlotConfig
from hal0d.lifecycle.runner import Runner, drain, log_state_change
from hal0d.lifecycle.slots import Slot, SlotState, SlotTable


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
        runner.config = after
    elif taken is not Step.TAKE_ON:  # taken on once the old process is gone
        runner.successor, runner.drain_s = after, drain_s
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


def added_slot(table: SlotTable, config: SlotConfig) -> Slot:
    """A slot the reload adds, in the table: told of its changes by whatever listener the
    first slots were given (contexts.dispatch_context wires one)."""
    listener = next((slot.on_change for slot in table), log_state_change)
    slot = Slot(config, on_change=listener)
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
