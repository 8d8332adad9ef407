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
current (a start an unload cancelled) tells nothing, so nothing stale reaches the table.

A load that fails (the process exits, or does not answer within `load_timeout_s`, or the group has
no room) fails every waiter at once with `slot.load_failed` naming the cause, and the next load is
not tried before the backoff (requests meanwhile get the same 503 with Retry-After). An unload
drains: the slot admits nothing new (`stopping`; its new requests queue and will load it again in
their turn) and its in-flight requests run to their end before its process is stopped. No request
is ever cut to make room. A reload is a config diff (ConfigDiff) handed to `apply`.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Final

from hal0d.config import GroupConfig, SlotConfig
from hal0d.errors import SlotLoadFailed, SlotLoading
from hal0d.lifecycle.groups import Groups, Member, NoRoom, Swap, SwapPhase, Withdrawn
from hal0d.lifecycle.machine import Action, Event, allows
from hal0d.lifecycle.probe import answers_within, port_taken, probe
from hal0d.lifecycle.process import Child, LaunchFailed, resolve_program
from hal0d.lifecycle.runner import (
    BACKOFF_FIRST_S,
    ConfigDiff,
    LifecycleObserver,
    LoadPhase,
    Progress,
    Runner,
    UnloadReason,
    log_state_change,
)
from hal0d.lifecycle.slots import Slot, SlotState, SlotTable
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

PROBE_INTERVAL_S: Final = 10.0
# A process that was up this long before it exited starts again from the first backoff step.
HEALTHY_RUN_S: Final = 60.0
FORCED_RETRY_AFTER_S: Final = 5.0
UP_STATES: Final = frozenset({SlotState.READY, SlotState.SERVING})


def no_request() -> contextvars.Context:
    """The context a timer of the lifecycle runs in: a fresh one, so an idle unload or a restart
    after a backoff logs no request id (a timer armed while a request ended would otherwise
    carry that request's, bound by the lifecycle middleware). What a request causes (the load it
    asks for, an eviction for that load) keeps its id."""
    return contextvars.Context()


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
        # Told of each slot a reload adds, once the manager has it (the event feed watches it).
        self.slot_added: list[Callable[[Slot], None]] = []
        # Told of each slot a reload changed, once its new config is in its view (the event
        # feed shows it: a page or `status --watch` would show the old one otherwise).
        self.slot_reconfigured: list[Callable[[Slot], None]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        for config in configs:
            self._adopt(config)

    # -- the one teller ----------------------------------------------------------------------

    def tell(self, runner: Runner, event: Event, reason: str | None = None) -> None:
        """Step the runner's slot by `event` and carry out what the table says. Once hal0d is
        shutting down, only `shutdown` is told: what a start or a stop still reports then is
        about a slot that is offline for good."""
        if self._stopping and event is not Event.SHUTDOWN:
            return
        rule = runner.slot.handle(event, reason)
        for action in rule.actions:
            self._ACTIONS[action](self, runner)

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

    def _adopt(self, config: SlotConfig) -> None:
        self.configs[config.name] = config
        if not config.command:
            return
        slot = self.table[config.name]
        self.runners[config.name] = Runner(slot, config)
        slot.watchers.append(self._on_change)
        slot.count_watchers.append(self._on_counts)
        slot.demand = self._demand if config.on_demand else None
        slot.turn_wait_s = self._turn_wait_s(config)

    def _turn_wait_s(self, config: SlotConfig) -> float:
        """The longest a request for `config`'s slot may wait for its model's turn (its
        group's `max_wait_s` when the group batches), on top of the load's own bound."""
        group = self.groups.get(config.group)
        if group is None or not group.config.batch or not config.on_demand:
            return 0.0
        return group.config.max_wait_s

    def _members(self, group: str) -> Iterator[Member]:
        for name, config in self.configs.items():
            runner = self.runners.get(name)
            if config.group == group and name in self.table:
                yield Member(self.table[name], config.memory_mib or 0,
                             evictable=runner is not None and config.on_demand,
                             last_used=runner.last_used if runner else 0.0)

    def _on_change(self, slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
        """The idle timer of an on-demand slot: armed while it is ready, cancelled otherwise;
        and its group told (a swap may wait for this slot's work to end)."""
        runner = self.runners.get(slot.name)
        if runner is None or runner.slot is not slot:
            return
        self.groups.poke(runner.config.group)
        if runner.idle_timer is not None:
            runner.idle_timer.cancel()
            runner.idle_timer = None
        if new in UP_STATES:
            runner.last_used = time.monotonic()
        if new is SlotState.READY and (idle_s := runner.idle_unload_s()) is not None:
            self._arm_idle(runner, idle_s)

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

    def _arm_idle(self, runner: Runner, after_s: float) -> None:
        if runner.idle_unload_s() is not None:
            runner.idle_timer = asyncio.get_running_loop().call_later(
                max(0.0, after_s), self._idle, runner, context=no_request())

    def keep_alive(self, name: str, seconds: float) -> None:
        """This load of an on-demand slot stays idle `seconds` before it unloads (0: unloads as
        soon as it is idle; negative: stays loaded), until it unloads; a client's keep_alive.
        Other slots are not unloaded by hal0d's idle timer: nothing changes for them."""
        runner = self.runners.get(name)
        if runner is None or not runner.config.on_demand or runner.keep_alive_s == seconds:
            return
        runner.keep_alive_s = seconds
        log.info("slot.keep_alive_set", slot=name, keep_alive_s=seconds)
        if runner.slot.state is SlotState.READY:
            if runner.idle_timer is not None:
                runner.idle_timer.cancel()
                runner.idle_timer = None
            if (idle_s := runner.idle_unload_s()) is not None:
                self._arm_idle(runner, idle_s - (time.monotonic() - runner.last_used))

    def _idle(self, runner: Runner) -> None:
        runner.idle_timer = None
        slot = runner.slot
        if slot.state is SlotState.READY and not slot.queued and not self._stopping:
            self._unload_now(runner, UnloadReason.IDLE)

    def _demand(self, slot: Slot) -> None:
        """A request found the on-demand slot stopped: it loads."""
        runner = self.runners.get(slot.name)
        if runner is not None and runner.slot is slot:
            self._start_if_resting(runner)

    def _start_if_resting(self, runner: Runner) -> None:
        if self._stopping or runner.busy or runner.slot.state is not SlotState.STOPPED:
            return
        self.tell(runner, Event.START)

    # -- the actions -------------------------------------------------------------------------

    def _bring_up(self, runner: Runner) -> None:
        if runner.retry is not None:
            runner.retry.cancel()
            runner.retry = None
        runner.keep_alive_s = None  # a new load (after a crash too): keep_alive was the last one's
        runner.job = self._spawn(self._start(runner))

    async def _start(self, runner: Runner) -> None:
        """The group's turn with room made, the launch, the probe until it answers; the outcome
        told as `answered`, `start_failed` or `load_failed`."""
        slot, config = runner.slot, runner.config
        progress = Progress(self.tell_phase, runner.name)
        log.info("slot.load_started", slot=runner.name, queued=slot.queued)
        cause: str | None = None
        urgent, runner.urgent = runner.urgent, False
        try:
            if self.groups.get(config.group) is not None:
                progress.enter(LoadPhase.WAITING_FOR_ROOM)
                slot.turn_wait(True)
            async with self.groups.turn(slot, config, pinned=not config.on_demand,
                                        urgent=urgent):
                slot.turn_wait(False)
                argv = " ".join(resolve_program(config.command or ()))
                launching = f"launching {argv}" if not config.on_demand else f"loading: {argv}"
                if runner.cause is not None:
                    launching += f" (the last attempt failed: {runner.cause})"
                self.tell(runner, Event.LAUNCH, launching)
                progress.enter(LoadPhase.STARTING)
                if (taken := port_taken(config.upstream)) is not None:
                    raise LaunchFailed(taken)
                child = await self._launch(runner)
                progress.enter(LoadPhase.PROBING)
                cause = await self._until_answering(
                    runner, child, config.load_timeout_s - progress.elapsed())
        except (LaunchFailed, NoRoom) as exc:
            cause = str(exc)
        except Withdrawn as exc:
            progress.stop()
            slot.turn_wait(False)
            runner.job = None
            log.info("slot.load_withdrawn", slot=runner.name, reason=str(exc))
            self.tell_phase(runner.name, LoadPhase.WITHDRAWN, progress.elapsed(), str(exc))
            if runner.wanted():
                self._start_if_resting(runner)  # a request came back in the same instant
            return
        finally:
            progress.stop()
            slot.turn_wait(False)
        elapsed = progress.elapsed()
        runner.job = None  # done: what the outcome's actions start is a job of its own
        if cause is not None:
            exit_code = runner.child.returncode if runner.child is not None else None
            await self._stop_child(runner)
            progress.enter(LoadPhase.FAILED, cause)
            self._failed(runner, cause, elapsed, exit_code)
            return
        up = runner.child
        assert up is not None
        runner.loaded_at = time.monotonic()
        runner.watch = self._spawn(self._watch(runner, up))
        log.info("slot.loaded", slot=runner.name, elapsed_s=elapsed, pid=up.pid)
        progress.enter(LoadPhase.READY)
        self.tell(runner, Event.ANSWERED)

    async def _launch(self, runner: Runner) -> Child:
        """Child.start, never left half done: cancelled while the process is being created, the
        process is still recorded (and so stopped by whoever cancelled)."""
        starting = asyncio.ensure_future(Child.start(runner.name, runner.config.command or ()))
        try:
            runner.child = await asyncio.shield(starting)
        except asyncio.CancelledError:
            if not starting.cancelled():
                await asyncio.wait({starting})
                if starting.exception() is None:
                    runner.child = starting.result()
            raise
        return runner.child

    async def _until_answering(self, runner: Runner, child: Child, timeout_s: float) -> str | None:
        """None once the new process answers its probe; else why it never will."""
        answering = asyncio.create_task(answers_within(self.client, runner.config, timeout_s))
        exited = asyncio.create_task(child.wait())
        try:
            await asyncio.wait({answering, exited}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            answering.cancel()
            exited.cancel()
        if exited.done() and not exited.cancelled():
            return child.exit_summary(exited.result())
        if answering.done() and not answering.cancelled() and answering.result():
            return None
        return f"not answering within load_timeout_s = {runner.config.load_timeout_s:g} s"

    def _failed(self, runner: Runner, cause: str, elapsed_s: float,
                exit_code: int | None) -> None:
        runner.cause = cause
        runner.retry_in_s = runner.backoff.take()
        if not runner.config.on_demand:
            runner.restarts += 1
        if exit_code is not None:
            log.warning("slot.process_exited", slot=runner.name, code=exit_code, reason=cause,
                        ran_s=elapsed_s, restart_in_s=runner.retry_in_s,
                        restarts=runner.restarts)
        log.warning("slot.load_failed", slot=runner.name, reason=cause, elapsed_s=elapsed_s,
                    retry_in_s=runner.retry_in_s)
        if runner.config.on_demand:
            self.tell(runner, Event.LOAD_FAILED, f"load failed: {cause}")
        else:
            # Before the state is ERROR (where leases are granted): nothing of ours listens.
            runner.slot.refuse_loads(cause, runner.retry_in_s)
            self.tell(runner, Event.START_FAILED,
                      f"{cause}; retrying in {runner.retry_in_s:g} s")

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

    async def _watch(self, runner: Runner, child: Child) -> None:
        """A process that exits on its own (not stopped by hal0d) is told as `exited`."""
        code = await child.wait()
        if runner.child is not child or self._stopping:
            return  # a stop ended it
        runner.child = None
        ran_s = time.monotonic() - (runner.loaded_at or time.monotonic())
        runner.loaded_at = None
        if ran_s >= HEALTHY_RUN_S:
            runner.backoff.reset()
        cause = child.exit_summary(code)
        slot = runner.slot
        if runner.wanted():
            runner.retry_in_s = runner.backoff.take()
            if not runner.config.on_demand:
                runner.restarts += 1
            log.warning("slot.process_exited", slot=runner.name, code=code, reason=cause,
                        ran_s=round(ran_s, 1), restart_in_s=runner.retry_in_s,
                        restarts=runner.restarts, in_flight=slot.in_flight, queued=slot.queued)
            cause = f"{cause}; restarting in {runner.retry_in_s:g} s"
        else:
            log.warning("slot.process_exited", slot=runner.name, code=code, reason=cause,
                        ran_s=round(ran_s, 1), in_flight=slot.in_flight, queued=slot.queued)
        if allows(slot.state, Event.EXITED):
            self.tell(runner, Event.EXITED, cause)

    def _recover(self, runner: Runner) -> None:
        """After an exit: started again after the backoff when wanted, else at rest now."""
        if runner.wanted():
            self._retry_later(runner)
        else:
            self.tell(runner, Event.REST, runner.slot.reason)

    def _stop_process(self, runner: Runner) -> None:
        cancelled, runner.job = runner.job, None
        runner.job = self._spawn(self._stop(runner, cancelled))

    async def _stop(self, runner: Runner, start: asyncio.Task[None] | None) -> None:
        """An unload (or a replace): the start it interrupts cancelled, the requests in flight
        drained, the process stopped; told as `gone`."""
        slot, reason = runner.slot, runner.unloading
        runner.cancel_timers()
        runner.keep_alive_s = None  # a client's keep_alive was this load's
        if start is not None and not start.done():
            start.cancel()
            await asyncio.wait({start})
        if slot.in_flight:
            log.info("slot.draining", slot=runner.name, in_flight=slot.in_flight,
                     reason=str(reason))
        await self._drain(slot, runner.drain_s)
        loaded_s = round(time.monotonic() - runner.loaded_at, 1) if runner.loaded_at else None
        await self._stop_child(runner)
        if runner.cause is None:
            runner.backoff.reset()  # a clean stop: the next start owes nothing to earlier ones
        log.info("slot.unloaded", slot=runner.name, reason=str(reason), loaded_s=loaded_s)
        for observer in self.observers:
            observer.unloaded(runner.name, reason, loaded_s)
        runner.job = None  # done: a start that `gone` leads to is a job of its own
        self.tell(runner, Event.GONE, f"unloaded ({reason})")

    async def _stop_child(self, runner: Runner) -> None:
        runner.loaded_at = None
        if runner.watch is not None:
            runner.watch.cancel()
            runner.watch = None
        if runner.child is not None:
            # Kept until it is gone: a stop cancelled on the way (a second reload's replace)
            # leaves it to the stop that follows, never running with nobody to stop it.
            await runner.child.stop()
            runner.child = None

    def _unloaded(self, runner: Runner) -> None:
        """The process is gone: a reload's new config is taken on; started again if wanted."""
        runner.drain_s = None
        if runner.successor is not None:
            self._take_on(runner, runner.successor)
        if self.runners.get(runner.name) is runner and runner.wanted():
            self._start_if_resting(runner)

    async def _drain(self, slot: Slot, drain_s: float | None) -> None:
        if drain_s is None:
            await slot.drained()
            return
        try:
            async with asyncio.timeout(drain_s):
                await slot.drained()
        except TimeoutError:
            log.warning("slot.drain_timeout", slot=slot.name, in_flight=slot.in_flight,
                        drain_s=drain_s)

    _ACTIONS: Final[dict[Action, Callable[[LifecycleManager, Runner], None]]] = {
        Action.BRING_UP: _bring_up,
        Action.LOADED: _loaded,
        Action.RETRY_LATER: _retry_later,
        Action.REFUSE_LOADS: _refuse_loads,
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
        if allows(slot.state, event):
            slot.handle(event, reason)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self.probe_once(name) for name in list(self.configs)))

    # -- the whole set -----------------------------------------------------------------------

    async def start(self) -> None:
        for runner in self.runners.values():
            self.tell(runner, Event.REST if runner.config.on_demand else Event.START)
        await asyncio.gather(*(self.probe_once(name) for name in self.configs
                               if name not in self.runners))
        self._spawn(self._probe_forever())

    def restarts(self) -> dict[str, int]:
        """How often each `always` slot's process was restarted since hal0d started."""
        return {name: r.restarts for name, r in self.runners.items() if not r.config.on_demand}

    def shut(self) -> None:
        """hal0d is shutting down: every slot goes offline (requests still queued get their
        503 now) and nothing is started or loaded any more."""
        self._stopping = True
        for runner in self.runners.values():
            runner.cancel_timers()
        for slot in self.table:
            slot.handle(Event.SHUTDOWN)

    async def stop(self) -> None:
        """hal0d is stopping: every process is stopped (the server's shutdown drained or ended
        the streams first), every slot goes offline."""
        self.shut()
        runners = list(self.runners.values())
        jobs = [r.job for r in runners if r.job is not None and not r.job.done()]
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)

        async def stop_one(runner: Runner) -> None:
            loaded = runner.child is not None
            await self._stop_child(runner)
            if loaded and runner.config.on_demand:
                log.info("slot.unloaded", slot=runner.name, reason=str(UnloadReason.SHUTDOWN))
                for observer in self.observers:
                    observer.unloaded(runner.name, UnloadReason.SHUTDOWN, None)

        await asyncio.gather(*(stop_one(runner) for runner in runners))
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def apply(self, diff: ConfigDiff, *, drain_s: float = 900.0) -> None:
        """A reload. New slots join the table and are probed (or started) before this returns;
        everything after that await runs in one step, and the caller swaps the Runtime right
        after, so no request is ever routed to a slot missing from the table. Removed slots go
        offline (their queued requests get a 503) and leave the table; their process stops once
        their leases are released (for at most `drain_s`). A slot whose command, upstream or
        start changed is unloaded (it drains, for at most `drain_s`, so in-flight streams
        finish on the old settings, and new requests queue meanwhile), then takes on its new
        config: an `always` one starts again at once, an on-demand one on its next request."""
        self.groups.replace(diff.groups)
        for runner in self.runners.values():
            runner.slot.turn_wait_s = self._turn_wait_s(runner.config)
        await self._add(diff.added)
        for name in diff.removed:
            self._remove(name, drain_s)
        for config in diff.changed:
            self._change(config, drain_s)
            for tell in self.slot_reconfigured:
                tell(self.table[config.name])

    async def _add(self, configs: Iterable[SlotConfig]) -> None:
        # Whatever listener contexts.lifecycle_context wired into the first slots, new ones get.
        listener = next((slot.on_change for slot in self.table), log_state_change)
        plain = []
        for config in configs:
            self.table.add(Slot(config, on_change=listener))
            self._adopt(config)
            for tell in self.slot_added:
                tell(self.table[config.name])
            runner = self.runners.get(config.name)
            if runner is None:
                plain.append(config.name)
            else:
                self.tell(runner, Event.REST if config.on_demand else Event.START)
        await asyncio.gather(*(self.probe_once(name) for name in plain))

    def _remove(self, name: str, drain_s: float) -> None:
        slot = self.table.remove(name)
        del self.configs[name]
        slot.handle(Event.SHUTDOWN)
        runner = self.runners.pop(name, None)
        if runner is not None:
            runner.cancel_timers()
            self._spawn(self._retire(runner, drain_s))

    async def _retire(self, runner: Runner, drain_s: float) -> None:
        """A removed slot's process, stopped once its leases are released."""
        job = runner.job
        if job is not None and not job.done():
            job.cancel()
            await asyncio.wait({job})
        try:
            await self._drain(runner.slot, drain_s)
        finally:
            await self._stop_child(runner)

    def _change(self, after: SlotConfig, drain_s: float) -> None:
        name = after.name
        before = self.configs[name]
        self.table[name].reconfigure(after)  # limits and the view; leases held keep counting
        self.configs[name] = after
        runner = self.runners.get(name)
        process = (before.command, before.upstream, before.start)
        if runner is None or process == (after.command, after.upstream, after.start):
            if runner is None and after.command:
                self._adopt(after)  # a probed upstream that hal0d now starts itself
                self.tell(self.runners[name], Event.START if not after.on_demand else Event.REST)
            elif runner is not None:
                self._reconfigure(runner, after)
            return
        state = runner.slot.state
        if state is SlotState.STOPPED and not runner.busy:
            self._take_on(runner, after)
            if self.runners.get(name) is runner and runner.wanted():
                self._start_if_resting(runner)
            return
        runner.successor, runner.drain_s = after, drain_s
        if state is SlotState.STOPPED:  # a load waiting for its group's room: cancelled
            self._unload_now(runner, UnloadReason.RELOAD)
            self._spawn(self._after(runner))
        elif state is SlotState.ERROR and runner.child is None and not runner.busy:
            # A process that exited and waits for its restart: the restart is the new one's.
            runner.cancel_timers()
            self._take_on(runner, after)
            if self.runners.get(name) is runner:
                if runner.wanted():
                    self.tell(runner, Event.START)
                elif not runner.slot.in_flight:
                    self.tell(runner, Event.REST, "reloaded: loads on the next request")
        elif after.command and not after.on_demand:
            self._replace_now(runner)
        else:
            self._unload_now(runner, UnloadReason.RELOAD)

    def _replace_now(self, runner: Runner) -> None:
        """An `always` slot's new process for a reload: `starting` at once (new requests wait
        for the new process) while the old one drains and stops; then the new one is brought
        up. A slot already stopping takes its successor on when its process is gone."""
        if not allows(runner.slot.state, Event.REPLACE):
            return
        runner.unloading = UnloadReason.RELOAD
        self.tell(runner, Event.REPLACE, "replacing its process (reload)")

    async def _after(self, runner: Runner) -> None:
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
            runner.slot.watchers.remove(self._on_change)
            runner.slot.count_watchers.remove(self._on_counts)
            runner.slot.turn_wait_s = 0.0
            self._spawn(self.probe_once(runner.name))
            return
        runner.config = after
        runner.slot.demand = self._demand if after.on_demand else None
        runner.slot.turn_wait_s = self._turn_wait_s(after)

    def _reconfigure(self, runner: Runner, after: SlotConfig) -> None:
        """Limits only. A changed idle_unload_s applies to the wait already running, counted
        from the slot's last use."""
        idle_before = runner.idle_unload_s()
        runner.config = after
        idle_after = runner.idle_unload_s()
        if idle_before != idle_after and runner.slot.state is SlotState.READY:
            if runner.idle_timer is not None:
                runner.idle_timer.cancel()
                runner.idle_timer = None
            if idle_after is not None:
                self._arm_idle(runner, idle_after - (time.monotonic() - runner.last_used))

    # -- views -------------------------------------------------------------------------------

    def unloads_in(self, name: str) -> float | None:
        """Seconds until the slot's idle timer unloads it: counted from its last use while it
        is ready, the whole timer while it serves; None when nothing will (a slot hal0d does
        not unload, an idle_unload_s of 0, a negative keep_alive)."""
        runner = self.runners.get(name)
        idle_s = runner.idle_unload_s() if runner is not None else None
        if runner is None or idle_s is None:
            return None
        if runner.slot.state is SlotState.READY:
            return max(0.0, idle_s - (time.monotonic() - runner.last_used))
        return idle_s

    def slot_view(self, slot: Slot) -> dict[str, Any]:
        """A slot as /api/slots and the event feed show it."""
        view = slot.snapshot()
        config = self.configs.get(slot.name)
        view["group"] = config.group if config else None
        view["memory_mib"] = config.memory_mib if config else None
        group = self.groups.get(config.group) if config else None
        view["group_memory_mib"] = group.config.memory_mib if group else None
        view["group_max_loaded"] = group.config.max_loaded if group else None
        if group is not None:
            pending = group.pending
            view["group_policy"] = group.config.policy
            view["group_max_wait_s"] = group.config.max_wait_s
            # A swap waiting for a batch to end, on the waiting slot's view and the victim's.
            view["pending_swap"] = (pending.view(time.monotonic()) if pending is not None
                                    and slot.name in (pending.slot, pending.victim) else None)
        runner = self.runners.get(slot.name)
        if runner is not None and runner.config.on_demand:
            view.update(self._lifecycle_view(runner))
        return view

    @staticmethod
    def _lifecycle_view(runner: Runner) -> dict[str, object]:
        now = time.monotonic()
        ready = runner.slot.state is SlotState.READY
        idle_unload_in = None
        if ready and (idle_s := runner.idle_unload_s()) is not None:
            idle_unload_in = max(0.0, idle_s - (now - runner.last_used))
        return {
            "start": runner.config.start,
            "loaded_for_s": round(now - runner.loaded_at, 1) if runner.loaded_at else None,
            "idle_for_s": round(now - runner.last_used, 1) if ready else None,
            "idle_unload_in_s": None if idle_unload_in is None else round(idle_unload_in, 1),
            "keep_alive_s": runner.keep_alive_s,
            "pid": runner.child.pid if runner.child else None,
        }
