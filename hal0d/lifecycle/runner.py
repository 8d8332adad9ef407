"""What the lifecycle manager keeps for each slot with a command (Runner: its process, its job,
its timers, its backoff, how long its loads took), and the steps of that process its jobs run
(load_jobs.py): a launch up to the first answer and the restore, a drain, a save, a stop.

A Runner never changes its slot's state: what its steps lead to, the manager tells the table.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from hal0d.config import SlotConfig
from hal0d.devices.placement import Placement
from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.out_of_memory import OutOfMemory
from hal0d.lifecycle.probe import port_taken, until_answering
from hal0d.lifecycle.process import Child, LaunchFailed
from hal0d.lifecycle.prompt_cache import PromptCache, Warmth, make_folder
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import LoadPhase, SlotState, Started, UnloadReason
from hal0d.logs import get_logger
from hal0d.programs import resolve_program
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

BACKOFF_FIRST_S: Final = 1.0
BACKOFF_MAX_S: Final = 60.0
LOAD_TICK_S: Final = 1.0
# A process that was up this long before it exited starts again from the first backoff step.
HEALTHY_RUN_S: Final = 60.0
# How many of a slot's last loads its measured load time is the median of: a few, so a cache
# that was cold once does not stand for every load, and a changed model shows within as many.
LOAD_HISTORY: Final = 5
# The busy spells a model's use is counted by (Runner.uses_since): enough for an hour of use.
USE_HISTORY: Final = 256


PhaseTeller = Callable[[str, "LoadPhase", float, "str | None"], None]


def no_request() -> contextvars.Context:
    """The context a timer of the lifecycle runs in: a fresh one, so an idle unload or a restart
    after a backoff logs no request id (a timer armed while a request ended would otherwise
    carry that request's, bound by the lifecycle middleware). What a request causes (the load it
    asks for, an eviction for that load) keeps its id."""
    return contextvars.Context()


@dataclass
class Backoff:
    """The pause before a failed or exited process is started again: 1 s, doubling to 60 s."""

    next_s: float = BACKOFF_FIRST_S

    def take(self) -> float:
        delay = self.next_s
        self.next_s = min(delay * 2, BACKOFF_MAX_S)
        return delay

    def reset(self) -> None:
        self.next_s = BACKOFF_FIRST_S


@dataclass(eq=False)
class Runner:
    """What the manager keeps for one slot with a command: its process, its one task (a start
    or a stop), its watch, its timers."""

    slot: Slot
    config: SlotConfig
    child: Child | None = None
    job: asyncio.Task[None] | None = None
    # Which job is current: one more at each start and stop, so what a superseded job reports
    # is dropped (LifecycleManager.report).
    job_generation: int = 0
    watch: asyncio.Task[None] | None = None
    retry: asyncio.TimerHandle | None = None
    idle_timer: asyncio.TimerHandle | None = None
    backoff: Backoff = field(default_factory=Backoff)
    retry_in_s: float = 0.0  # the backoff of the last failure, for its actions
    cause: str | None = None  # why the last start failed
    # Why the model itself did not load, the last time it tried (not for want of room): until
    # its config changes or an operator loads it, its loads evict nothing (groups.py), so a
    # broken model never unloads a working one again and again.
    load_error: str | None = None
    last_used: float = field(default_factory=time.monotonic)
    # When its model began its last busy spells (monotonic): how often it is used, which the
    # price of unloading it for room on the devices weighs (device_room.reload_cost).
    busy_since: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=USE_HISTORY))
    loaded_at: float | None = None
    # When its last unload's requests in flight were done: a swap's cost begins there.
    drained_at: float | None = None
    # The times of its last loads that answered, each from its launch to its first good probe
    # (not the wait for room): what its group's turns and wait bounds learn from.
    load_times: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=LOAD_HISTORY))
    restarts: int = 0
    unloading: UnloadReason = UnloadReason.API
    drain_s: float | None = None  # the bound of the unload's drain (a reload's), None: none
    successor: SlotConfig | None = None  # a reload's config, taken on once the process is gone
    # This load's idle timer as a client asked for it (Ollama's keep_alive), in place of
    # idle_unload_s until the slot unloads: 0 unloads once idle, negative never.
    keep_alive_s: float | None = None
    urgent: bool = False  # the next start was asked for by the API: it waits for no batch
    # The conversations its slot holds warm (conversations.Affinity), told what a stop and a
    # restore do to them.
    warmth: Warmth | None = None
    cache: PromptCache | None = None  # its saved prompt caches: prompt_cache()

    @property
    def name(self) -> str:
        return self.slot.name

    def prompt_cache(self) -> PromptCache | None:
        """The saved caches of the current config's command; None when it saves none."""
        folder = self.config.prompt_cache_dir
        if folder is None:
            return None
        if self.cache is None or str(self.cache.folder) != folder:
            self.cache = PromptCache(self.name, Path(folder))
        return self.cache if self.config.saves_prompt_cache else None

    async def keep_warm(self, client: UpstreamClient) -> None:
        """Before its process stops (nothing in flight): its prompt caches saved, when it saves
        them and the next process can read them (a reload's new command could not); else the
        conversations it held are cold."""
        cache = self.prompt_cache()
        next_folder = (self.successor or self.config).prompt_cache_dir
        saved = cache is not None and next_folder == self.config.prompt_cache_dir and (
            await cache.save(client, self.config,
                             self.warmth.conversations(self.name) if self.warmth else []))
        if not saved:
            self.cold()

    def cold(self) -> None:
        """Its process is gone with what it had read."""
        if self.warmth is not None:
            self.warmth.forget_slot(self.name)

    async def warm_up(self, client: UpstreamClient) -> None:
        """A new process answers: the caches the last one saved restored into it before the
        first request is admitted; their conversations are the slot's again."""
        cache = self.prompt_cache()
        held = await cache.restore(client, self.config) if cache is not None else []
        if held and self.warmth is not None:
            self.warmth.adopt(self.name, held)

    def used(self, at: float) -> None:
        self.busy_since.append(at)

    def uses_since(self, since: float) -> int:
        """How many busy spells began since `since` (monotonic), of the last USE_HISTORY."""
        return sum(1 for at in self.busy_since if at >= since)

    @property
    def busy(self) -> bool:
        return self.job is not None and not self.job.done()

    @property
    def load_s(self) -> float | None:
        """Its measured load time: the median of its last loads; None before the first."""
        return round(statistics.median(self.load_times), 3) if self.load_times else None

    def wanted(self) -> bool:
        """An `always` slot is wanted all the time; an on-demand one while requests are there."""
        return not self.config.on_demand or bool(self.slot.queued or self.slot.in_flight)

    def idle_unload_s(self) -> float | None:
        """How long this load may stay idle before it unloads; None: for ever."""
        if not self.config.on_demand:
            return None
        if self.keep_alive_s is not None:
            return None if self.keep_alive_s < 0 else self.keep_alive_s
        return self.config.idle_unload_s or None

    # -- the record's other writers: what the manager's jobs and steps set ------------------

    def _fire(self, fired: Callable[[], None], fire: Callable[[Runner], None]) -> None:
        fired()
        fire(self)

    def idle_timer_fired(self) -> None:
        self.idle_timer = None

    def retry_fired(self) -> None:
        self.retry = None

    def retry_later(self, fire: Callable[[Runner], None]) -> None:
        """Its start tried again after the backoff of its last failure."""
        self.retry = asyncio.get_running_loop().call_later(
            self.retry_in_s, self._fire, self.retry_fired, fire, context=no_request())

    def new_load(self) -> None:
        """A start begins (after a crash too): a retry waiting is moot, and a client's
        keep_alive was the last load's."""
        if self.retry is not None:
            self.retry.cancel()
            self.retry = None
        self.keep_alive_s = None

    def loaded(self) -> None:
        """A start answered: its last failure's cause forgotten, loads allowed again."""
        self.cause = None
        self.slot.allow_loads()

    def no_room(self, cause: str) -> None:
        """Its group could not make room: the cause its waiters get (no backoff taken)."""
        self.cause = cause

    def take_backoff(self) -> None:
        """The pause before its start is tried again, without a failure of its own (a restart
        that leases in flight wait for found no room)."""
        self.retry_in_s = self.backoff.take()

    def cannot_launch(self, problem: str) -> str:
        """Its command cannot be launched: said before any model is unloaded for it."""
        self.load_error = problem
        return problem

    def take_urgent(self) -> bool:
        """Whether this load was asked for by an operator (it waits for no batch); once."""
        urgent, self.urgent = self.urgent, False
        return urgent

    def make_urgent(self) -> None:
        self.urgent = True

    def unload_for(self, reason: UnloadReason) -> None:
        self.unloading = reason

    def watched_by(self, watch: asyncio.Task[None]) -> None:
        """The task that waits for its process's exit (the manager's)."""
        self.watch = watch

    def take_on(self, after: SlotConfig) -> None:
        """A reload's config, now its own: a new config may well load."""
        self.config, self.load_error, self.successor = after, None, None

    def succeed_by(self, after: SlotConfig, drain_s: float) -> None:
        """A reload's config, taken on once its process is gone, which drains for at most
        `drain_s` first."""
        self.successor, self.drain_s = after, drain_s

    def unloaded(self) -> None:
        self.drain_s = None

    def cancel_timers(self) -> None:
        for timer in (self.retry, self.idle_timer):
            if timer is not None:
                timer.cancel()
        self.retry = self.idle_timer = None

    def disarm_idle(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    def keep_alive(self, seconds: float, fire: Callable[[Runner], None]) -> None:
        """A client's keep_alive for this load (manager.keep_alive): the idle timer armed anew
        from the last use when it changed and the slot is ready."""
        if self.keep_alive_s == seconds:
            return
        self.keep_alive_s = seconds
        log.info("slot.keep_alive_set", slot=self.name, keep_alive_s=seconds)
        if self.slot.state is SlotState.READY:
            self.arm_idle(fire, from_last_use=True)

    def arm_idle(self, fire: Callable[[Runner], None], *, from_last_use: bool = False) -> None:
        """The idle timer, armed anew: `fire` is told once the slot was idle its idle wait,
        counted from now or `from_last_use`; only cancelled when hal0d does not unload it."""
        self.disarm_idle()
        if (idle_s := self.idle_unload_s()) is None:
            return
        if from_last_use:
            idle_s -= time.monotonic() - self.last_used
        self.idle_timer = asyncio.get_running_loop().call_later(
            max(0.0, idle_s), self._fire, self.idle_timer_fired, fire, context=no_request())

    # -- its process -------------------------------------------------------------------------

    def launch_words(self) -> str:
        """What a launch says it launches, with the last attempt's failure."""
        argv = " ".join(resolve_program(self.config.command or ()))
        what = f"launching {argv}" if not self.config.on_demand else f"loading: {argv}"
        if self.cause is not None:
            what += f" (the last attempt failed: {self.cause})"
        return what

    async def bring_up(self, client: UpstreamClient, progress: Progress,
                       placement: Placement | None = None) -> str | None:
        """The launch (on `placement`'s devices), the probe until it answers, and the restore
        of its saved caches, in its group's turn (load_jobs.py holds it): None once the new
        process answers and has its caches back, else why not (a process that was launched is
        left for `ended` to stop). A stop cancels this whole, the restore too."""
        config = self.config
        try:
            progress.enter(LoadPhase.STARTING)
            if (taken := port_taken(config.upstream)) is not None:
                raise LaunchFailed(taken)
            if config.prompt_cache_dir is not None:
                make_folder(config.prompt_cache_dir)
            if (cache := self.prompt_cache()) is not None:
                cache.launching(config.command or ())
            launched = time.monotonic()
            child = await self.launch(placement)
            progress.enter(LoadPhase.PROBING)
            # load_timeout_s is the load's own: its wait for a turn in its group is not in it.
            failure = await until_answering(client, config, child,
                                            config.load_timeout_s - (time.monotonic() - launched))
        except LaunchFailed as exc:
            failure = str(exc)
        self.load_error = failure
        if failure is not None:
            return failure
        self.load_times.append(time.monotonic() - launched)
        child.answering()
        await self.warm_up(client)
        return None

    def out_of_memory(self) -> OutOfMemory | None:
        """What its process said of memory it could not have while it loaded (the load that
        just failed, before `ended` stops it)."""
        return self.child.out_of_memory if self.child is not None else None

    async def ended(self, cause: str | None, progress: Progress) -> Started:
        """A start's outcome from its cause: a failed one's process stopped and its backoff
        taken (FAILED); else it is loaded (ANSWERED)."""
        elapsed = progress.elapsed()
        if cause is not None:
            exit_code = self.child.returncode if self.child is not None else None
            await self.stop_child()
            progress.enter(LoadPhase.FAILED, cause)
            self.failed(cause, elapsed, exit_code)
            return Started.FAILED
        assert self.child is not None
        self.loaded_at = time.monotonic()
        log.info("slot.loaded", slot=self.name, elapsed_s=elapsed, pid=self.child.pid,
                 measured_s=round(self.load_times[-1], 3), load_s=self.load_s)
        progress.enter(LoadPhase.READY)
        return Started.ANSWERED

    async def launch(self, placement: Placement | None = None) -> Child:
        """Child.start (on `placement`'s devices), never left half done: cancelled while the
        process is being created, the process is still recorded (and so stopped by whoever
        cancelled)."""
        command = self.config.command or ()
        argv, env = (tuple(placement.command(command)), placement.environment(command)) if (
            placement is not None) else (command, {})
        # Where hal0d's environment names its devices, it numbers them in placement's order.
        devices = placement.devices if placement is not None and env else ()
        starting = asyncio.ensure_future(Child.start(self.name, argv, env, devices))
        try:
            self.child = await asyncio.shield(starting)
        except asyncio.CancelledError:
            if not starting.cancelled():
                await asyncio.wait({starting})
                if starting.exception() is None:
                    self.child = starting.result()
            raise
        return self.child

    async def wind_down(self, start: asyncio.Task[None] | None,
                        observers: LifecycleObserver, client: UpstreamClient) -> None:
        """An unload's (or a replace's) steps: the start it interrupts cancelled, the requests
        in flight drained, the prompt caches saved, the process stopped, the observers told."""
        slot, reason = self.slot, self.unloading
        self.cancel_timers()
        self.keep_alive_s = None  # a client's keep_alive was this load's
        if start is not None and not start.done():
            start.cancel()
            await asyncio.wait({start})
        if slot.in_flight:
            log.info("slot.draining", slot=self.name, in_flight=slot.in_flight,
                     reason=str(reason))
        await drain(slot, self.drain_s)
        self.drained_at = time.monotonic()
        loaded_s = round(time.monotonic() - self.loaded_at, 1) if self.loaded_at else None
        if self.child is not None and self.loaded_at is not None:
            await self.keep_warm(client)
        await self.stop_child()
        if self.cause is None:
            self.backoff.reset()  # a clean stop: the next start owes nothing to earlier ones
        log.info("slot.unloaded", slot=self.name, reason=str(reason), loaded_s=loaded_s)
        observers.unloaded(self.name, reason, loaded_s)

    async def shut_down(self, observers: LifecycleObserver, client: UpstreamClient) -> None:
        """hal0d stops: the prompt caches saved, the process stopped, the observers told of a
        load it ends."""
        loaded = self.child is not None
        if loaded and self.loaded_at is not None:
            await self.keep_warm(client)
        await self.stop_child()
        if loaded and self.config.on_demand:
            log.info("slot.unloaded", slot=self.name, reason=str(UnloadReason.SHUTDOWN))
            observers.unloaded(self.name, UnloadReason.SHUTDOWN, None)

    async def stop_child(self) -> None:
        self.loaded_at = None
        if self.watch is not None:
            self.watch.cancel()
            self.watch = None
        if self.child is not None:
            # Kept until it is gone: a stop cancelled on the way (a second reload's replace)
            # leaves it to the stop that follows, never running with nobody to stop it.
            await self.child.stop()
            self.child = None

    def failed(self, cause: str, elapsed_s: float, exit_code: int | None) -> None:
        """A start failed: its cause kept (the next launch names it), its backoff taken."""
        self.cause = cause
        self.retry_in_s = self.backoff.take()
        if not self.config.on_demand:
            self.restarts += 1
        if exit_code is not None:
            log.warning("slot.process_exited", slot=self.name, code=exit_code, reason=cause,
                        ran_s=elapsed_s, restart_in_s=self.retry_in_s, restarts=self.restarts)
        log.warning("slot.load_failed", slot=self.name, reason=cause, elapsed_s=elapsed_s,
                    retry_in_s=self.retry_in_s)

    def exited(self, child: Child, code: int) -> str:
        """Its process, up, exited on its own: forgotten, its backoff reset after a healthy
        run and taken when it is wanted again; returns the cause the slot shows."""
        self.child = None
        self.cold()
        ran_s = time.monotonic() - (self.loaded_at or time.monotonic())
        self.loaded_at = None
        if ran_s >= HEALTHY_RUN_S:
            self.backoff.reset()
        cause = child.exit_summary(code)
        slot = self.slot
        if not self.wanted():
            log.warning("slot.process_exited", slot=self.name, code=code, reason=cause,
                        ran_s=round(ran_s, 1), in_flight=slot.in_flight, queued=slot.queued)
            return cause
        self.retry_in_s = self.backoff.take()
        if not self.config.on_demand:
            self.restarts += 1
        log.warning("slot.process_exited", slot=self.name, code=code, reason=cause,
                    ran_s=round(ran_s, 1), restart_in_s=self.retry_in_s,
                    restarts=self.restarts, in_flight=slot.in_flight, queued=slot.queued)
        return f"{cause}; restarting in {self.retry_in_s:g} s"


async def drain(slot: Slot, drain_s: float | None) -> None:
    """Returns once nothing is in flight on `slot`, or after `drain_s` (None: no bound)."""
    if drain_s is None:
        await slot.drained()
        return
    try:
        async with asyncio.timeout(drain_s):
            await slot.drained()
    except TimeoutError:
        log.warning("slot.drain_timeout", slot=slot.name, in_flight=slot.in_flight,
                    drain_s=drain_s)


class Progress:
    """A start's current phase, told to the observers at once and every LOAD_TICK_S."""

    def __init__(self, tell: PhaseTeller, slot: str) -> None:
        self.tell = tell
        self.slot = slot
        self.started = time.monotonic()
        self.phase = LoadPhase.STARTING
        self._ticker: asyncio.Task[None] | None = None

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def enter(self, phase: LoadPhase, reason: str | None = None) -> None:
        self.phase = phase
        self.tell(self.slot, phase, self.elapsed(), reason)
        if phase in (LoadPhase.READY, LoadPhase.FAILED):
            self.stop()
        elif self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(LOAD_TICK_S)
            self.tell(self.slot, self.phase, self.elapsed(), None)

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None
