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

Beside this module: the steps of a process's start and stop are its runner's (runner.py), what
a reload asks of each slot is decided in reload.py, and what /api/slots shows is built in
views.py; none of them tells a slot a lifecycle event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from hal0d.config import GroupConfig, SlotConfig
from hal0d.errors import SlotLoadFailed, SlotLoading
from hal0d.lifecycle import prompt_cache, reload, views
from hal0d.lifecycle.groups import Groups, Member, Swap, SwapPhase
from hal0d.lifecycle.machine import Action, Event, allows
from hal0d.lifecycle.probe import probe
from hal0d.lifecycle.process import Child
from hal0d.lifecycle.prompt_cache import Warmth
from hal0d.lifecycle.reload import Step
from hal0d.lifecycle.runner import (
    BACKOFF_FIRST_S,
    ConfigDiff,
    LifecycleObserver,
    LoadPhase,
    Runner,
    Started,
    UnloadReason,
    no_request,
)
from hal0d.lifecycle.slots import Slot, SlotState, SlotTable
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

PROBE_INTERVAL_S: Final = 10.0
FORCED_RETRY_AFTER_S: Final = 5.0
# How long a refused connect waits for its process's exit to be seen: the kernel closes a dying
# process's sockets a moment before its parent learns of the exit. A process still running after
# this refused on its own.
EXIT_SEEN_S: Final = 2.0
UP_STATES: Final = frozenset({SlotState.READY, SlotState.SERVING})


class LifecycleManager:
    """Every slot's lifecycle in one application."""

    def __init__(
        self,
        table: SlotTable,
        configs: Iterable[SlotConfig],
        client: UpstreamClient,
        *,
        groups: dict[str, GroupConfig] | None = None,
        end_streams: Callable[[str, str], int] = lambda slot, reason: 0,
        warmth: Warmth | None = None,
        cache_root: Path | None = None,
    ) -> None:
        self.table = table
        self.client = client
        # Every slot's config, the ones without a command too (probed; counted in groups).
        self.configs: dict[str, SlotConfig] = {}
        self.runners: dict[str, Runner] = {}
        self.groups = Groups(groups or {}, self._members, self._evict, self._settled,
                             self._swapped)
        # Ends the in-flight streams of a slot with their surface's terminal frame (a forced
        # unload); returns how many it ended.
        self.end_streams = end_streams
        self.observers: list[LifecycleObserver] = []
        # The conversations slots hold warm, and where their saved caches live (prompt_cache.py).
        self.warmth = warmth
        self.cache_root = cache_root
        # Told of each slot a reload adds, once the manager has it (the event feed watches it).
        self.slot_added: list[Callable[[Slot], None]] = []
        # Told of each slot a reload changed, once its view has the new config (the event feed).
        self.slot_reconfigured: list[Callable[[Slot], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        for config in configs:
            self._adopt(config)

    # -- the one teller ----------------------------------------------------------------------

    def tell(self, runner: Runner, event: Event, reason: str | None = None) -> None:
        """Step the runner's slot by `event` and carry out what the table says."""
        for action in self._step(runner.slot, event, reason):
            self._ACTIONS[action](self, runner)

    def report(self, runner: Runner, generation: int, event: Event,
               reason: str | None = None) -> bool:
        """What a job (a start or a stop) reports, told only while that job is the runner's
        current one: a job a later one superseded (its start cancelled by an unload, a stop
        followed by a new load) reports about a process that is not the slot's any more, and
        is dropped. True when it was told."""
        if generation != runner.job_generation or self.runners.get(runner.name) is not runner:
            log.info("lifecycle.stale_event", slot=runner.name, told=str(event),
                     generation=generation, current=runner.job_generation)
            return False
        self.tell(runner, event, reason)
        return True

    def _step(self, slot: Slot, event: Event, reason: str | None = None) -> tuple[Action, ...]:
        """The one place the manager changes a slot's state (admission tells its two lease
        events itself); the step's actions are the caller's to carry out. Once hal0d is
        shutting down, only `shutdown` is told: what a start, a stop or a probe still reports
        then is about a slot that is offline for good."""
        if self._stopping and event is not Event.SHUTDOWN:
            return ()
        return slot.handle(event, reason).actions

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        """A task of the manager's own (stop() cancels what is left of them)."""
        name = getattr(coro, "__qualname__", None)
        task: asyncio.Task[None] = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            # A bug of hal0d's: said once, loudly, instead of a waiter left hanging unawares.
            log.error("lifecycle.task_failed", task=task.get_name(),
                      error=repr(exc), exc_info=exc)

    # -- wiring ------------------------------------------------------------------------------

    def _adopt(self, config: SlotConfig) -> Runner | None:
        """`config` kept; with a command, its slot gets a runner wired to it."""
        self.configs[config.name] = config
        if not config.command:
            return None
        slot = self.table[config.name]
        runner = self.runners[config.name] = Runner(slot, config, warmth=self.warmth)
        slot.watchers.append(self._on_change)
        slot.count_watchers.append(self._on_counts)
        slot.demand = self._demand if config.on_demand else None
        slot.exit_seen = self._exit_seen
        self.groups.refresh(config.group)  # its wait bound, and its group's others' with it
        return runner

    def _begin(self, runner: Runner) -> None:
        """A runner's first event: an on-demand slot rests, an `always` one starts."""
        self.tell(runner, Event.REST if runner.config.on_demand else Event.START)

    def _members(self, group: str) -> Iterator[Member]:
        for name, config in self.configs.items():
            runner = self.runners.get(name)
            if config.group == group and name in self.table:
                yield Member(self.table[name], config.memory_mib or 0,
                             evictable=runner is not None and config.on_demand,
                             last_used=runner.last_used if runner else 0.0,
                             loaded_at=runner.loaded_at if runner else None,
                             load_s=runner.load_s if runner else None,
                             settling=runner is not None and runner.busy
                             and runner.child is not None,
                             without_process=runner is not None and runner.child is None)

    def _on_change(self, slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
        """The idle timer of an on-demand slot: armed while it is ready, cancelled otherwise;
        and its group told (a swap may wait for this slot's work to end)."""
        runner = self.runners.get(slot.name)
        if runner is None or runner.slot is not slot:
            return
        self.groups.poke(runner.config.group)
        if new in UP_STATES:
            runner.last_used = time.monotonic()
        if new is SlotState.READY:
            runner.arm_idle(self._idle)
        else:
            runner.disarm_idle()

    def _on_counts(self, slot: Slot) -> None:
        runner = self.runners.get(slot.name)
        if runner is not None and runner.slot is slot:
            self.groups.poke(runner.config.group)

    def _swapped(self, swap: Swap) -> None:
        """A step of a swap in a group: the waiting slot's turn has come once it starts."""
        runner = self.runners.get(swap.slot)
        if runner is not None and swap.phase is SwapPhase.STARTED:
            runner.slot.turn_wait(False)
        log.info(f"swap.{swap.phase}", group=swap.group, slot=swap.slot, victim=swap.victim,
                 waited_s=swap.waited_s, why=swap.why)
        for observer in self.observers:
            observer.swap(swap)

    def keep_alive(self, name: str, seconds: float) -> None:
        """This load of an on-demand slot stays idle `seconds` before it unloads (0: unloads as
        soon as it is idle; negative: stays loaded), until it unloads; a client's keep_alive.
        Other slots are not unloaded by hal0d's idle timer: nothing changes for them."""
        if (runner := self.runners.get(name)) is not None and runner.config.on_demand:
            runner.keep_alive(seconds, self._idle)

    def _idle(self, runner: Runner) -> None:
        runner.idle_timer = None
        slot = runner.slot
        if slot.state is SlotState.READY and not slot.queued and not self._stopping:
            self._unload_now(runner, UnloadReason.IDLE if runner.keep_alive_s is None
                             else UnloadReason.KEEP_ALIVE)

    def _demand(self, slot: Slot) -> None:
        """A request found the on-demand slot stopped: it loads."""
        runner = self.runners.get(slot.name)
        if runner is not None and runner.slot is slot:
            self._start_if_resting(runner)

    def _start_if_resting(self, runner: Runner) -> None:
        if self._stopping or runner.busy or runner.slot.state is not SlotState.STOPPED:
            return
        self.tell(runner, Event.START)

    async def _exit_seen(self, slot: Slot) -> bool:
        """A lease's connect to the slot was refused: True once its process is seen gone (at
        once when it is gone or being started again), False when it still runs after
        EXIT_SEEN_S."""
        runner = self.runners.get(slot.name)
        if runner is None or runner.slot is not slot or self._stopping:
            return False
        child = runner.child
        if child is None or slot.state is SlotState.STARTING:
            return True
        return await child.exited_within(EXIT_SEEN_S)

    # -- the actions -------------------------------------------------------------------------

    def _bring_up(self, runner: Runner) -> None:
        if runner.retry is not None:
            runner.retry.cancel()
            runner.retry = None
        runner.keep_alive_s = None  # a new load (after a crash too): keep_alive was the last one's
        runner.job_generation += 1
        runner.job = self._spawn(self._start(runner, runner.job_generation))

    async def _start(self, runner: Runner, generation: int) -> None:
        """A load's one job (Runner.start, its restore included): `launch` told once the
        group's turn is had, the outcome told as `answered`, `no_room`, `start_failed` or
        `load_failed`. It is over (`job` None) in the same step as its outcome is told: what the
        outcome's actions start is a job of its own. A stop cancels it: it then tells nothing."""
        try:
            started = await runner.start(self.client, self.groups, self.tell_phase,
                                         lambda what: self._launching(runner, generation, what))
        except Exception as exc:  # a bug of hal0d's: the load fails rather than wedge the slot
            log.error("lifecycle.task_failed", task="start", slot=runner.name,
                      error=repr(exc), exc_info=exc)
            await runner.stop_child()
            runner.failed(f"hal0d failed to load it ({exc!r})", 0.0, None)
            started = Started.FAILED
        if generation != runner.job_generation:
            return  # superseded while it ended: its outcome is not the slot's any more
        runner.job = None
        if started is Started.WITHDRAWN:
            if runner.wanted():
                self._start_if_resting(runner)  # a request came back in the same instant
        elif started is Started.ANSWERED:
            assert runner.child is not None
            runner.watch = self._spawn(self._watch(runner, runner.child))
            self.report(runner, generation, Event.ANSWERED)
        elif started is Started.NO_ROOM and not runner.slot.in_flight:
            self.report(runner, generation, Event.NO_ROOM, runner.cause)
        elif (runner.config.on_demand and not runner.slot.in_flight
              and started is Started.FAILED):
            self.report(runner, generation, Event.LOAD_FAILED, f"load failed: {runner.cause}")
        else:
            if started is Started.NO_ROOM:  # restarting under leases in flight: retried later
                runner.retry_in_s = runner.backoff.take()
            # An `always` slot's start, or the restart that requests in flight waited for (their
            # connect was refused as the process died): retried after the backoff while wanted.
            # Before the state is ERROR (where leases are granted): nothing of ours listens.
            runner.slot.refuse_loads(runner.cause or "unknown", runner.retry_in_s)
            self.tell(runner, Event.START_FAILED,
                      f"{runner.cause}; retrying in {runner.retry_in_s:g} s")

    def _launching(self, runner: Runner, generation: int, what: str) -> None:
        """The start's turn is had and its process launches: a new run of the slot's process."""
        runner.slot.generation += 1
        self.report(runner, generation, Event.LAUNCH, what)

    def _loaded(self, runner: Runner) -> None:
        runner.cause = None
        runner.slot.load_refused = None

    def _retry_later(self, runner: Runner) -> None:
        runner.retry = asyncio.get_running_loop().call_later(
            runner.retry_in_s, self._retry, runner, context=no_request())

    def _retry(self, runner: Runner) -> None:
        runner.retry = None
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

    async def _watch(self, runner: Runner, child: Child) -> None:
        """A process that exits on its own (not stopped by hal0d) is told as `exited`."""
        code = await child.wait()
        if runner.child is not child or self._stopping:
            return  # a stop ended it
        cause = runner.exited(child, code)
        if allows(runner.slot.state, Event.EXITED):
            self.tell(runner, Event.EXITED, cause)

    def _recover(self, runner: Runner) -> None:
        """After an exit: restarted after the backoff when wanted (requests wait), else rests."""
        if runner.wanted():
            runner.slot.hold(runner.slot.reason or "process exited")
            self._retry_later(runner)
        else:
            self.tell(runner, Event.REST, runner.slot.reason)

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

    def _unloaded(self, runner: Runner) -> None:
        """The process is gone: a reload's new config is taken on; started again if wanted."""
        runner.drain_s = None
        if runner.successor is not None:
            self._take_on(runner, runner.successor)
        if self.runners.get(runner.name) is runner and runner.wanted():
            self._start_if_resting(runner)

    _ACTIONS: Final[dict[Action, Callable[[LifecycleManager, Runner], None]]] = {
        Action.BRING_UP: _bring_up,
        Action.LOADED: _loaded,
        Action.RETRY_LATER: _retry_later,
        Action.REFUSE_LOADS: _refuse_loads,
        Action.FAIL_WAITERS: _fail_waiters,
        Action.RECOVER: _recover,
        Action.STOP_PROCESS: _stop_process,
        Action.UNLOADED: _unloaded,
    }

    # -- what the API, the groups and the idle timer ask -------------------------------------

    def tell_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        for observer in self.observers:
            observer.load_phase(slot, phase, elapsed_s, reason)

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
        if slot.state not in UP_STATES and not self._stopping:
            if not runner.busy and runner.child is None and slot.state in (SlotState.STOPPED,
                                                                            SlotState.ERROR):
                runner.urgent = True  # an operator's load waits for no batch
                self.tell(runner, Event.START)  # at rest, or waiting out a backoff
            job = runner.job
            if job is not None and not job.done():
                await asyncio.wait({job})  # not shield(): a cancelled job is an outcome here
                if job.cancelled():
                    raise SlotLoading(f"slot {name!r} was unloaded while it loaded",
                                      retry_after=FORCED_RETRY_AFTER_S)
        if slot.state not in UP_STATES:
            raise SlotLoadFailed(f"slot {name!r} did not load: {slot.reason}",
                                 retry_after=BACKOFF_FIRST_S)

    async def unload(self, name: str, reason: UnloadReason, *, force: bool = False) -> None:
        """Drains the slot (nothing new admitted, in-flight requests run to their end; with
        `force`, they are ended with their surface's terminal frame and the queued get a 503),
        then stops its process; returns once the process is gone."""
        runner = self.runners[name]
        if force:
            ended = self.end_streams(name, "unloaded")
            runner.slot.fail_waiters(SlotLoading(f"slot {name!r} was unloaded",
                                                 retry_after=FORCED_RETRY_AFTER_S))
            log.info("slot.unload_forced", slot=name, streams_ended=ended)
        self._unload_now(runner, reason)
        job = runner.job
        if runner.slot.state is SlotState.STOPPING and job is not None:
            await asyncio.wait({job})

    def _unload_now(self, runner: Runner, reason: UnloadReason) -> None:
        slot = runner.slot
        if slot.state is SlotState.STOPPED and runner.busy:
            assert runner.job is not None
            runner.job.cancel()  # a load still waiting for its group's room
            return
        if not allows(slot.state, Event.UNLOAD) or slot.state is SlotState.STOPPING:
            return
        runner.unloading = reason
        self.tell(runner, Event.UNLOAD, f"unloading ({reason})")

    async def _evict(self, name: str) -> None:
        await self.unload(name, UnloadReason.EVICTED)

    async def _settled(self, name: str) -> None:
        runner = self.runners.get(name)
        if runner is not None and runner.job is not None:
            await asyncio.wait({runner.job})

    # -- probing -----------------------------------------------------------------------------

    async def probe_once(self, name: str) -> None:
        """Asks the slot's upstream once and tells the answer, `probe_ok` or `probe_failed`,
        like every other task: after a shutdown the teller refuses it."""
        slot = self.table.get(name)
        config = self.configs.get(name)
        if slot is None or config is None:
            return  # removed by a reload while this probe round was starting
        runner = self.runners.get(name)
        if runner is not None and (runner.child is None or runner.busy):
            return  # no process to ask, or its own start or stop owns the slot now
        if slot.in_flight:
            # Requests in flight already show the upstream alive (the stall guard watches them),
            # and llama-cpp-python's server interrupts a running completion for any request.
            return
        if slot.state not in (SlotState.OFFLINE, SlotState.READY, SlotState.ERROR):
            return
        child = runner.child if runner else None
        reason = await probe(self.client, config)
        if self.table.get(name) is not slot or self.configs.get(name) is not config:
            return  # a reload replaced the slot meanwhile: this answer is about the old one
        if runner is not None and (runner.child is not child or runner.busy):
            return  # its process changed meanwhile
        event = Event.PROBE_OK if reason is None else Event.PROBE_FAILED
        if not allows(slot.state, event):
            return
        if runner is not None:
            self.tell(runner, event, reason)
        else:
            self._step(slot, event, reason)  # a slot without a command: no actions to carry out

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self.probe_once(name) for name in list(self.configs)))

    # -- the whole set -----------------------------------------------------------------------

    async def start(self) -> None:
        self.sweep_caches()
        for runner in self.runners.values():
            self._begin(runner)
        await asyncio.gather(*(self.probe_once(name) for name in self.configs
                               if name not in self.runners))
        self._spawn(self._probe_forever())

    def sweep_caches(self) -> None:
        """The saved caches no slot's command reads any more, deleted (prompt_cache.sweep)."""
        if self.cache_root is not None:
            prompt_cache.sweep(self.cache_root, [*self.configs.values(),
                                                 *(r.config for r in self.runners.values())])

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

    # -- a reload (reload.py says what it asks of each slot) ---------------------------------

    async def apply(self, diff: ConfigDiff, *, drain_s: float = 900.0) -> None:
        """A reload (reload.py: what it asks of each slot). New slots join the table and are
        probed (or started) before this returns; everything after that await runs in one step,
        and the caller swaps the Runtime right after, so no request is ever routed to a slot
        missing from the table. What drains (a removed slot's leases, the streams of a process
        that changed) drains for at most `drain_s`."""
        self.groups.replace(diff.groups)
        plain: list[str] = []
        for config in diff.added:
            slot = reload.added_slot(self.table, config)
            adopted = self._adopt(config)
            for tell in self.slot_added:
                tell(slot)
            if adopted is None:
                plain.append(config.name)
            else:
                self._begin(adopted)
        await asyncio.gather(*(self.probe_once(name) for name in plain))
        for name in diff.removed:
            self._remove(name, drain_s)
        for config in diff.changed:
            self._change(config, drain_s)
            for tell in self.slot_reconfigured:
                tell(self.table[config.name])
        for runner in self.runners.values():  # the groups' members as the reload left them
            runner.slot.turn_wait_s = self.groups.turn_wait_s(runner.config)
        self.sweep_caches()

    def _remove(self, name: str, drain_s: float) -> None:
        slot = self.table.remove(name)
        del self.configs[name]
        self._step(slot, Event.SHUTDOWN)
        runner = self.runners.pop(name, None)
        if runner is not None:
            runner.cancel_timers()
            runner.cold()
            self._spawn(reload.retire(runner, drain_s))

    def _change(self, after: SlotConfig, drain_s: float) -> None:
        name, runner = after.name, self.runners.get(after.name)
        idle_before = runner.idle_unload_s() if runner is not None else None
        step = reload.change(self.table, self.configs, runner, after, drain_s)
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
                runner.unloading = UnloadReason.RELOAD
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
        runner.successor = None
        if not after.command:  # now an upstream hal0d only probes
            del self.runners[runner.name]
            runner.slot.demand = None
            runner.slot.exit_seen = None
            runner.slot.watchers.remove(self._on_change)
            runner.slot.count_watchers.remove(self._on_counts)
            runner.slot.turn_wait_s = 0.0
            self._spawn(self.probe_once(runner.name))
            return
        runner.config, runner.load_error = after, None  # a new config may well load
        runner.slot.demand = self._demand if after.on_demand else None
        runner.slot.turn_wait_s = self.groups.turn_wait_s(after)
        self.sweep_caches()  # the old command's caches, now that its process is gone

    # -- views (views.py builds them) --------------------------------------------------------

    def unloads_in(self, name: str) -> float | None:
        """Seconds until the slot's idle timer unloads it; None when nothing will."""
        return views.unloads_in(self.runners.get(name), time.monotonic())

    def slot_view(self, slot: Slot) -> dict[str, Any]:
        """A slot as /api/slots and the event feed show it."""
        config = self.configs.get(slot.name)
        group = self.groups.get(config.group) if config else None
        return views.slot_view(slot, config, group, self.runners.get(slot.name),
                               self.warmth.warm(slot.name) if self.warmth else 0)
