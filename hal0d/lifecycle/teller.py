"""The lifecycle manager's ground floor: what it keeps (every slot's config and runner, the
groups, its tasks), its one teller of lifecycle events, the wiring of each slot to it, and its
probes. The manager (manager.py) is built on it with its load and stop jobs (load_jobs.py) and a
reload's steps (reload.py); together they are the one writer of every slot's lifecycle.

The teller (`tell`) steps a slot by the table (machine.py) and carries out the step's actions,
each by the manager's method of the action's name. A job reports through `report`, with the
generation it was started for: what a superseded job reports is dropped. Once hal0d shuts down,
the teller refuses every event but `shutdown` (a probe's late answer too).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from hal0d.config import GroupConfig, SlotConfig
from hal0d.devices.watch import Devices
from hal0d.errors import SlotLoading
from hal0d.lifecycle import prompt_cache
from hal0d.lifecycle.footprints import Footprints
from hal0d.lifecycle.groups import DEVICES_GROUP, Group, Groups
from hal0d.lifecycle.machine import Action, Event, allows
from hal0d.lifecycle.observers import LifecycleObserver, Observers
from hal0d.lifecycle.probe import probe
from hal0d.lifecycle.prompt_cache import Warmth
from hal0d.lifecycle.room import Member, Pricing, Swap, queue_bound_s
from hal0d.lifecycle.runner import Runner
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.table import SlotTable
from hal0d.lifecycle.vocabulary import UP, LoadPhase, SlotState, SwapPhase, UnloadReason
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

PROBE_INTERVAL_S: Final = 10.0
# What a request queued for a slot that was unloaded by force is told to wait before it retries.
FORCED_RETRY_AFTER_S: Final = 5.0
# How long a refused connect waits for its process's exit to be seen: the kernel closes a dying
# process's sockets a moment before its parent learns of the exit. A process still running after
# this refused on its own.
EXIT_SEEN_S: Final = 2.0


class Teller:
    """What the lifecycle manager keeps, and its one teller."""

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
        self.groups = Groups(groups or {})
        self.groups.on_turn_end = self.regrant
        self._regranting = False  # regrant under way: the grants it makes ask nothing again
        # Ends the in-flight streams of a slot with their surface's terminal frame (a forced
        # unload); returns how many it ended.
        self.end_streams = end_streams
        # Everyone told what the lifecycle does (subscribe), the manager's own reactions first.
        self.observers = Observers(own=self)
        # The conversations slots hold warm, and where their saved caches live (prompt_cache.py).
        self.warmth = warmth
        self.cache_root = cache_root
        # What each model took on the devices at its last load (footprints.py: measured where
        # the devices are read, raised by a load that ran out of memory).
        self.footprints = Footprints(self.configs.get)
        # The devices' memory, read afresh for each load (device_jobs.py; set where hal0d
        # reads devices): None, nothing placed.
        self.devices: Devices | None = None
        # The box's own turn, swaps and pricing: loads take it where devices are read.
        self.on_devices = Group(GroupConfig(name=DEVICES_GROUP))
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False
        for slot in table:
            slot.observer = self.observers
        for config in configs:
            self._adopt(config)

    def subscribe(self, observer: LifecycleObserver) -> None:
        """`observer` is told what the lifecycle does from now on, every slot there is first."""
        self.observers.subscribe(observer, self.table)

    # -- the one teller ----------------------------------------------------------------------

    def tell(self, runner: Runner, event: Event, reason: str | None = None) -> None:
        """Step the runner's slot by `event` and carry out what the table says."""
        for action in self._step(runner.slot, event, reason):
            # Each action is carried out by the manager's method of its name (`_bring_up`, ...).
            getattr(self, f"_{action}")(runner)

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

    def tell_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        self.observers.load_phase(slot, phase, elapsed_s, reason)

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
        self._wire(runner)
        self.refresh_bounds(config.group)  # its wait bound, and its group's others' with it
        return runner

    def _wire(self, runner: Runner) -> None:
        """What admission asks of the manager for a slot whose process it runs, as its current
        config says: a load when a request finds it stopped (on demand), its process's fate
        when a connect is refused, the wait for its model's turn in its group."""
        slot, config = runner.slot, runner.config
        slot.demand = self._demand if config.on_demand else None
        slot.exit_seen = self._exit_seen
        slot.process_runs = self._process_runs
        slot.turn_wait_s = self.turn_wait_s(config)
        slot.hold_grants = self._holds_grants if config.group else None

    @staticmethod
    def _unwire(slot: Slot) -> None:
        """A slot whose process the manager runs no more (a reload took its command away)."""
        slot.demand = None
        slot.exit_seen = None
        slot.process_runs = None
        slot.turn_wait_s = 0.0
        slot.hold_grants = None

    def _begin(self, runner: Runner) -> None:
        """A runner's first event: an on-demand slot rests, an `always` one starts."""
        self.tell(runner, Event.REST if runner.config.on_demand else Event.START)

    def _members(self, group: str | None) -> Iterator[Member]:
        for name, config in self.configs.items():
            if config.group == group and (member := self.member_of(name)) is not None:
                yield member

    def member_of(self, name: str) -> Member | None:
        """What room making needs to know of a slot (room.Member); None for no slot."""
        config = self.configs.get(name)
        if config is None or name not in self.table:
            return None
        runner = self.runners.get(name)
        return Member(self.table[name], self.memory_of(config),
                      evictable=runner is not None and config.on_demand,
                      last_used=runner.last_used if runner else 0.0,
                      loaded_at=runner.loaded_at if runner else None,
                      load_s=runner.load_s if runner else None,
                      settling=runner is not None and runner.busy and runner.child is not None,
                      without_process=runner is not None and runner.child is None)

    def memory_of(self, config: SlotConfig) -> int:
        """What a slot's model takes where its group counts memory: what it took at its last
        load with this command (footprints.py, once the devices are read), else its
        `memory_mib`."""
        return self.footprints.learned_mib(config) or config.memory_mib or 0

    def turn_wait_s(self, config: SlotConfig) -> float:
        """The longest a request for `config`'s slot may wait for its model's turn in its group,
        or on the box where devices are read (room.queue_bound_s), on top of the load's own
        bound."""
        if not config.on_demand or (shared := self._sharing(config.group)) is None:
            return 0.0
        return queue_bound_s(*shared)

    def refresh_bounds(self, name: str | None) -> None:
        """Every slot of the group (None: of none, sharing the box) given its wait bound anew:
        a member came, or a load or a swap was measured."""
        if (shared := self._sharing(name)) is None:
            return
        pricing, members = shared
        bound = queue_bound_s(pricing, members)
        for member in members:
            member.slot.turn_wait_s = bound if member.evictable else 0.0

    def _sharing(self, group_name: str | None) -> tuple[Pricing, list[Member]] | None:
        """The pricing and members of a group, or, for the slots in none, of the box where
        devices are read; None: the slot shares nothing it waits a turn for."""
        group = self.groups.get(group_name)
        if group is not None:
            return group.pricing(), list(self._members(group.config.name))
        if group_name is None and self.devices is not None and self.devices.reads():
            return self.on_devices.pricing(), list(self._members(None))
        return None

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None:
        """The idle timer of an on-demand slot: armed while it is ready, cancelled otherwise;
        and its group told (a swap may wait for this slot's work to end)."""
        runner = self.runners.get(slot.name)
        if runner is None or runner.slot is not slot:
            return
        self.groups.poke(runner.config.group)
        self.on_devices.poke()
        self.regrant(runner.config.group)
        if new in UP:
            runner.last_used = time.monotonic()
        if new is SlotState.SERVING:
            runner.used(runner.last_used)
        if new is SlotState.READY:
            runner.arm_idle(self._idle)
        else:
            runner.disarm_idle()

    def counts_changed(self, slot: Slot) -> None:
        runner = self.runners.get(slot.name)
        if runner is not None and runner.slot is slot:
            self.groups.poke(runner.config.group)
            self.on_devices.poke()
            self.regrant(runner.config.group)

    def _holds_grants(self, slot: Slot) -> bool:
        """A model with batch work alone takes none of it while a load of its group with
        interactive work waits or is under way: that load unloads it for a model with
        interactive work, and the batch answers it took would drain first (a whole answer
        added to the chat's wait). Its requests wait in its queue, as they would once it is
        unloaded; it takes them once that load's turn is over, if it is still loaded."""
        runner = self.runners.get(slot.name)
        group = self.groups.get(runner.config.group) if runner is not None else None
        return group is not None and not slot.urgent() and group.interactive_load(slot)

    def regrant(self, group: str | None) -> None:
        """The members of `group` that held their grants look again (a member's work, or the
        group's loads, changed); a grant it makes tells its counts, which asks again: once."""
        if group is None or self._regranting:
            return
        self._regranting = True
        try:
            for runner in list(self.runners.values()):
                if runner.config.group == group and runner.slot.queued:
                    runner.slot.regrant()
        finally:
            self._regranting = False

    def _idle(self, runner: Runner) -> None:
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

    def _process_runs(self, slot: Slot) -> bool:
        """Whether the process of the slot's runner runs now (a lease asks before it connects);
        True for a slot that is not the runner's any more (nothing of the manager's to say)."""
        runner = self.runners.get(slot.name)
        if runner is None or runner.slot is not slot:
            return True
        return runner.child is not None and runner.child.running

    def _unload_now(self, runner: Runner, reason: UnloadReason) -> None:
        slot = runner.slot
        if slot.state is SlotState.STOPPED and runner.busy:
            assert runner.job is not None
            runner.job.cancel()  # a load still waiting for its group's room
            return
        if not allows(slot.state, Event.UNLOAD) or slot.state is SlotState.STOPPING:
            return
        runner.unload_for(reason)
        self.tell(runner, Event.UNLOAD, f"unloading ({reason})")

    def sweep_caches(self) -> None:
        """The saved caches no slot's command reads any more, deleted (prompt_cache.sweep)."""
        if self.cache_root is not None:
            prompt_cache.sweep(self.cache_root, [*self.configs.values(),
                                                 *(r.config for r in self.runners.values())])

    # -- what the jobs share ----------------------------------------------------------------

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

    def _tell_swap(self, group: Group, phase: SwapPhase, me: Slot, victim: Member,
                   why: str) -> None:
        """A step of a swap in a group, told to the log and the observers; the waiting slot's
        turn has come once it starts."""
        since = me.oldest_waiting_since()
        waited = 0.0 if since is None else round(time.monotonic() - since, 3)
        limits = group.config
        swap = Swap(limits.name, phase, me.name, victim.slot.name, waited, why, limits.policy,
                    limits.max_wait_s)
        if phase is SwapPhase.STARTED:
            me.turn_wait(False)
        log.info(f"swap.{swap.phase}", group=swap.group, slot=swap.slot, victim=swap.victim,
                 waited_s=swap.waited_s, why=swap.why)
        self.observers.swap(swap)

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
            return
        back = event is Event.PROBE_OK and slot.state not in UP
        self._step(slot, event, reason)  # a slot without a command: no actions to carry out
        if back and slot.state in UP:
            # The server answers again after it did not: it may be another run, or another
            # program, so what was learnt of the last one (its /props, its modes) is asked anew.
            slot.generation += 1

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self.probe_once(name) for name in list(self.configs)))
