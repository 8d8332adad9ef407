"""The lifecycle manager: the one that brings slots up, watches them, and takes them down.

Every slot with a command, `start = "always"` or `"on_demand"`, runs through one process machine:
start (the group's turn and room, launch, probe until it answers), serve, stop, with one backoff.
The policies differ only in when a process is wanted: an `always` slot's all the time (started
with hal0d, restarted after its backoff when it exits), an on-demand slot's while requests want
it (loaded by the first one, unloaded when idle for `idle_unload_s` or evicted to make room in
its group). A slot without a command is an upstream hal0d only probes.

The manager is the only teller of a slot's lifecycle events (machine.py has the table): its own
tasks (a start, a stop, a process's watch, the probe) report what happened as events, the table
decides the step, and the manager carries out the step's actions. A task that is no longer
current (a start an unload cancelled) tells nothing, so nothing stale reaches the table; once
hal0d shuts down, the teller refuses every event but `shutdown` (a probe's late answer too).

A load that fails (the process exits, or does not answer within `load_timeout_s`, or the group has
no room) fails every waiter at once with `slot.load_failed` naming the cause, and the next load is
not tried before the backoff (requests meanwhile get the same 503 with Retry-After). A process
that exits while it is wanted holds its slot (Slot.hold) until the restart answers: nothing is
granted meanwhile, requests wait for the restart in the queue, and a request whose connect was
refused in the instant before the exit was seen waits for it too (Slot.process_fate). An unload
drains: the slot admits nothing new (`stopping`; its new requests queue and will load it again in
their turn) and its in-flight requests run to their end before its process is stopped. No request
is ever cut to make room. A reload is a config diff (ConfigDiff) handed to `apply`.

Beside this module: what the manager keeps and its one teller are teller.py's, its load and stop
jobs load_jobs.py's (room in a group decided in room.py), a reload's steps reload.py's, the
steps of a process's start and stop its runner's (runner.py), and what /api/slots shows is built
in views.py; only the manager's own modules tell a slot a lifecycle event.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from hal0d.errors import SlotLoadFailed, SlotLoading
from hal0d.lifecycle import views
from hal0d.lifecycle.load_jobs import LoadJobs
from hal0d.lifecycle.machine import Event
from hal0d.lifecycle.reload import Reloads
from hal0d.lifecycle.runner import BACKOFF_FIRST_S, Runner
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.teller import EXIT_SEEN_S, FORCED_RETRY_AFTER_S
from hal0d.lifecycle.vocabulary import UP, SlotState

__all__ = ["EXIT_SEEN_S", "LifecycleManager"]


class LifecycleManager(LoadJobs, Reloads):
    """Every slot's lifecycle in one application."""

    def keep_alive(self, name: str, seconds: float) -> None:
        """This load of an on-demand slot stays idle `seconds` before it unloads (0: unloads as
        soon as it is idle; negative: stays loaded), until it unloads; a client's keep_alive.
        Other slots are not unloaded by hal0d's idle timer: nothing changes for them."""
        if (runner := self.runners.get(name)) is not None and runner.config.on_demand:
            runner.keep_alive(seconds, self._idle)

    # -- the actions -------------------------------------------------------------------------

    def _loaded(self, runner: Runner) -> None:
        runner.loaded()

    def _retry_later(self, runner: Runner) -> None:
        runner.retry_later(self._retry)

    def _retry(self, runner: Runner) -> None:
        if self._stopping or runner.busy or runner.slot.state is not SlotState.ERROR:
            return
        if runner.wanted():
            self.tell(runner, Event.START)
        elif not runner.slot.in_flight:
            self.tell(runner, Event.REST)

    def _refuse_loads(self, runner: Runner) -> None:
        runner.slot.refuse_loads(runner.cause or "unknown", runner.retry_in_s)

    def _fail_waiters(self, runner: Runner) -> None:
        runner.slot.refuse_loads(runner.cause or "unknown", FORCED_RETRY_AFTER_S, backoff=False)

    def _recover(self, runner: Runner) -> None:
        """After an exit: restarted after the backoff when wanted (requests wait), else rests."""
        if runner.wanted():
            runner.slot.hold(runner.slot.reason or "process exited")
            self._retry_later(runner)
        else:
            self.tell(runner, Event.REST, runner.slot.reason)

    # -- what the API, the groups and the idle timer ask -------------------------------------

    def request_load(self, name: str) -> None:
        """Starts a load if the slot rests; returns at once."""
        self._start_if_resting(self.runners[name])

    async def load(self, name: str) -> None:
        """Loads the slot (the admin API's load, which an operator may ask for during a failed
        load's backoff); returns once it is ready. An unload under way finishes first, then the
        slot loads. SlotLoading when an unload cancels the load this waits for; SlotLoadFailed
        with the cause when the load fails."""
        runner = self.runners[name]
        slot = runner.slot
        if slot.state is SlotState.STOPPING and runner.job is not None:
            await asyncio.wait({runner.job})
        if slot.state not in UP and not self._stopping:
            if not runner.busy and runner.child is None and slot.state in (SlotState.STOPPED,
                                                                            SlotState.ERROR):
                runner.make_urgent()  # an operator's load waits for no batch
                self.tell(runner, Event.START)  # at rest, or waiting out a backoff
            job = runner.job
            if job is not None and not job.done():
                await asyncio.wait({job})  # not shield(): a cancelled job is an outcome here
                if job.cancelled():
                    raise SlotLoading(f"slot {name!r} was unloaded while it loaded",
                                      retry_after=FORCED_RETRY_AFTER_S)
        if slot.state not in UP:
            raise SlotLoadFailed(f"slot {name!r} did not load: {slot.reason}",
                                 retry_after=BACKOFF_FIRST_S)

    # -- the whole set -----------------------------------------------------------------------

    async def start(self) -> None:
        self.sweep_caches()
        for runner in self.runners.values():
            self._begin(runner)
        await asyncio.gather(*(self.probe_once(name) for name in self.configs
                               if name not in self.runners))
        self._spawn(self._probe_forever())

    def slot_pids(self) -> dict[int, str]:
        """Each running slot process's pid (its process group's too): what a device's
        processes are told apart by (hal0d/devices)."""
        return {runner.child.pid: name for name, runner in self.runners.items()
                if runner.child is not None}

    def restarts(self) -> dict[str, int]:  # since hal0d started, of each `always` slot
        return {name: r.restarts for name, r in self.runners.items() if not r.config.on_demand}

    def shut(self) -> None:
        """hal0d is shutting down: every slot goes offline (requests still queued get their
        503 now) and nothing is started, loaded or probed up any more."""
        self._stopping = True
        for runner in self.runners.values():
            runner.cancel_timers()
        for slot in self.table:
            self._step(slot, Event.SHUTDOWN)

    async def stop(self) -> None:
        """hal0d is stopping: every process is stopped (the server's shutdown drained or ended
        the streams first), every slot goes offline."""
        self.shut()
        runners = list(self.runners.values())
        jobs = [r.job for r in runners if r.job is not None and not r.job.done()]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await asyncio.gather(*(r.shut_down(self.observers, self.client) for r in runners))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # -- views (views.py builds them) --------------------------------------------------------

    def unloads_in(self, name: str) -> float | None:
        """Seconds until the slot's idle timer unloads it; None when nothing will."""
        return views.unloads_in(self.runners.get(name), time.monotonic())

    def group_views(self) -> list[dict[str, Any]]:
        """Each group as /api/slots shows it (views.group_view)."""
        now = time.monotonic()
        return [views.group_view(group, list(self._members(name)), now)
                for name, group in self.groups.groups.items()]

    def slot_view(self, slot: Slot) -> dict[str, Any]:
        """A slot as /api/slots and the event feed show it."""
        config = self.configs.get(slot.name)
        group = self.groups.get(config.group) if config else None
        return views.slot_view(slot, config, group, self.runners.get(slot.name),
                               self.warmth.warm(slot.name) if self.warmth else 0)
