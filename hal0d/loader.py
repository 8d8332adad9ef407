"""On-demand slots: a model loaded for the first request that needs it, unloaded when idle, and
evicted to make room for another model of its group.

A slot with `start = "on_demand"` rests in `stopped`. The first request for it starts a load and
waits in the slot's own FIFO queue (slots.py); more requests during the load wait behind it, so
twenty requests cause one load and are served in arrival order. A load is: make room in the
slot's group, start the command (child.py), probe the upstream until it answers, `ready`. A load
that fails (the process exits, or does not answer within `load_timeout_s`, or the group has no
room) fails every waiter at once with `slot.load_failed` naming the cause, and the next load is
not tried before a backoff (requests meanwhile get the same 503 with Retry-After).

Making room: the loads of a group take turns (one group lock, FIFO), so two models never load
onto one device at once. While the group's limits would be exceeded (`max_loaded`, the
`memory_mib` budget, or less free memory than the slot needs by `free_memory_command`), the
least recently used loaded on-demand slot of the group is unloaded, idle ones first. An unload
drains: the victim admits nothing new (`stopping`; its new requests queue and will load it again
in their turn) and its in-flight requests run to their end before its process is stopped. No
request is ever cut to make room. `start = "always"` slots count against the limits and are never
evicted.

Idle: an on-demand slot `ready` with nothing queued for `idle_unload_s` (0 = never) is unloaded.
A process that exits on its own while idle leaves its slot `stopped`; with requests in flight or
queued it is loaded again.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import aiohttp

from hal0d.child import Child, LaunchFailed, resolve_program
from hal0d.config import GroupConfig, SlotConfig
from hal0d.errors import SlotLoadFailed, SlotLoading
from hal0d.logs import get_logger
from hal0d.probe import answers_within
from hal0d.slots import Slot, SlotState, SlotTable

log = get_logger()

LOAD_BACKOFF_FIRST_S = 1.0
LOAD_BACKOFF_MAX_S = 60.0
FREE_MEMORY_TIMEOUT_S = 10.0
FORCED_RETRY_AFTER_S = 5.0
LOAD_TICK_S = 1.0
# The states in which a slot's process is alive (or being started): it occupies its device.
LOADED = frozenset({
    SlotState.STARTING, SlotState.READY, SlotState.SERVING, SlotState.ERROR, SlotState.STOPPING,
})


class UnloadReason(enum.StrEnum):
    IDLE = "idle"
    EVICTED = "evicted"
    API = "api"
    RELOAD = "reload"
    SHUTDOWN = "shutdown"


class LoadPhase(enum.StrEnum):
    WAITING_FOR_ROOM = "waiting_for_room"
    STARTING = "starting"
    PROBING = "probing"
    READY = "ready"
    FAILED = "failed"


class LifecycleObserver(Protocol):
    """Told what the loader does, for the event feed and the metrics (never the slot's own
    state changes: those reach Slot.watchers)."""

    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        """A load's phase; repeated every LOAD_TICK_S while it lasts."""

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None: ...


class _Progress:
    """A load's current phase, told to the observers at once and every LOAD_TICK_S."""

    def __init__(self, loader: Loader, slot: str) -> None:
        self.loader = loader
        self.slot = slot
        self.started = time.monotonic()
        self.phase = LoadPhase.STARTING
        self._ticker: asyncio.Task[None] | None = None

    def elapsed(self) -> float:
        return round(time.monotonic() - self.started, 3)

    def enter(self, phase: LoadPhase, reason: str | None = None) -> None:
        self.phase = phase
        self.loader.tell_phase(self.slot, phase, self.elapsed(), reason)
        if phase in (LoadPhase.READY, LoadPhase.FAILED):
            self.stop()
        elif self._ticker is None:
            self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(LOAD_TICK_S)
            self.loader.tell_phase(self.slot, self.phase, self.elapsed(), None)

    def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            self._ticker = None


class NoRoom(Exception):
    """The group cannot make room for a load: the cause is the load's failure."""


@dataclass(eq=False)
class Model:
    """The lifecycle state of one on-demand slot."""

    slot: Slot
    config: SlotConfig
    child: Child | None = None
    load_task: asyncio.Task[None] | None = None
    unload_task: asyncio.Task[None] | None = None
    watch_task: asyncio.Task[None] | None = None
    idle_timer: asyncio.TimerHandle | None = None
    last_used: float = field(default_factory=time.monotonic)
    backoff_s: float = LOAD_BACKOFF_FIRST_S
    loaded_at: float | None = None

    @property
    def name(self) -> str:
        return self.slot.name

    def cancel_idle_timer(self) -> None:
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None


@dataclass(eq=False)
class Group:
    config: GroupConfig
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


async def free_memory_mib(group: GroupConfig) -> int | None:
    """What the group's free_memory_command reports (the first number it prints), or None when
    it cannot be run or read (logged; the load then goes by the static limits alone)."""
    assert group.free_memory_command is not None
    argv = resolve_program(group.free_memory_command)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        log.warning("group.free_memory_failed", group=group.name, error=str(exc))
        return None
    try:
        async with asyncio.timeout(FREE_MEMORY_TIMEOUT_S):
            out, err = await process.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        log.warning("group.free_memory_failed", group=group.name,
                    error=f"no answer within {FREE_MEMORY_TIMEOUT_S:g} s")
        return None
    found = re.search(rb"\d+", out)
    if process.returncode != 0 or found is None:
        log.warning("group.free_memory_failed", group=group.name, code=process.returncode,
                    output=(out or err)[:200].decode("utf-8", "replace").strip())
        return None
    return int(found.group())


class Loader:
    """Loads and unloads the on-demand slots of one application."""

    def __init__(
        self,
        table: SlotTable,
        configs: Iterable[SlotConfig],
        groups: dict[str, GroupConfig],
        session: aiohttp.ClientSession,
        end_streams: Callable[[str, str], int],
    ) -> None:
        self.table = table
        self.session = session
        self.groups = {name: Group(config) for name, config in groups.items()}
        # Every slot's config, `always` ones included: they count in their group's limits.
        self.configs: dict[str, SlotConfig] = {}
        # Ends the in-flight streams of a slot with their surface's terminal frame (a forced
        # unload); returns how many it ended.
        self.end_streams = end_streams
        self.models: dict[str, Model] = {}
        self.observers: list[LifecycleObserver] = []
        self._stopping = False
        for config in configs:
            self.add(config)

    # -- wiring ------------------------------------------------------------------------------

    def add(self, config: SlotConfig) -> None:
        """A slot of the table: an on-demand one comes under the loader's care and rests
        `stopped`; an `always` one is only counted in its group."""
        self.configs[config.name] = config
        if not config.on_demand:
            return
        slot = self.table[config.name]
        self.models[config.name] = Model(slot, config)
        slot.wants_load = self._wants_load
        slot.watchers.append(self._on_change)
        if slot.state is SlotState.OFFLINE:
            slot.transition(SlotState.STOPPED, "not loaded: loads on the first request")

    def _wants_load(self, slot: Slot) -> None:
        model = self.models.get(slot.name)
        if model is None or self._stopping or slot.state is not SlotState.STOPPED:
            return
        if model.load_task is None or model.load_task.done():
            model.load_task = asyncio.create_task(self._load(model))

    def _on_change(self, slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
        model = self.models.get(slot.name)
        if model is None or model.slot is not slot:
            return
        model.cancel_idle_timer()
        if new in (SlotState.READY, SlotState.SERVING):
            model.last_used = time.monotonic()
        if new is SlotState.READY and model.config.idle_unload_s > 0:
            loop = asyncio.get_running_loop()
            model.idle_timer = loop.call_later(model.config.idle_unload_s, self._idle, model)

    def _idle(self, model: Model) -> None:
        model.idle_timer = None
        slot = model.slot
        if slot.state is SlotState.READY and not slot.queued and not self._stopping:
            self.unload_soon(model.name, UnloadReason.IDLE)

    # -- loading -----------------------------------------------------------------------------

    def request_load(self, name: str) -> None:
        """Starts a load if the slot rests; returns at once."""
        self._wants_load(self.models[name].slot)

    async def load(self, name: str) -> None:
        """Loads the slot (the admin API's load, which an operator may ask for during a failed
        load's backoff); returns once it is ready, or raises SlotLoadFailed with the cause."""
        model = self.models[name]
        slot = model.slot
        if slot.state in (SlotState.READY, SlotState.SERVING):
            return
        if slot.state is SlotState.STOPPING and model.unload_task is not None:
            await asyncio.shield(model.unload_task)
        if slot.state is SlotState.STOPPED and (model.load_task is None or model.load_task.done()):
            model.load_task = asyncio.create_task(self._load(model))
        if model.load_task is not None:
            await asyncio.shield(model.load_task)
        if slot.state not in (SlotState.READY, SlotState.SERVING):
            raise SlotLoadFailed(f"slot {name!r} did not load: {slot.reason}",
                                 retry_after=LOAD_BACKOFF_FIRST_S)

    def tell_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        for observer in self.observers:
            observer.load_phase(slot, phase, elapsed_s, reason)

    async def _load(self, model: Model) -> None:
        slot = model.slot
        progress = _Progress(self, model.name)
        log.info("slot.load_started", slot=model.name, queued=slot.queued)
        child: Child | None = None
        try:
            cause = None
            async with self._turn(model, progress):
                progress.enter(LoadPhase.STARTING)
                command = model.config.command or ()
                argv = " ".join(resolve_program(command))
                slot.transition(SlotState.STARTING, f"loading: {argv}")
                child = await Child.start(model.name, command)
                progress.enter(LoadPhase.PROBING)
                left_s = model.config.load_timeout_s - progress.elapsed()
                cause = await self._until_answering(model, child, left_s)
        except (LaunchFailed, NoRoom) as exc:
            cause = str(exc)
        except asyncio.CancelledError:
            progress.stop()
            if child is not None:
                await child.stop()
            if slot.state is SlotState.STARTING:
                slot.transition(SlotState.STOPPED, "load cancelled")
            raise
        elapsed = progress.elapsed()
        if cause is not None:
            if child is not None:
                await child.stop()
            progress.enter(LoadPhase.FAILED, cause)
            self._load_failed(model, cause, elapsed)
            return
        assert child is not None
        model.child, model.loaded_at = child, time.monotonic()
        model.backoff_s = LOAD_BACKOFF_FIRST_S
        model.watch_task = asyncio.create_task(self._watch(model, child))
        slot.load_refused = None
        log.info("slot.loaded", slot=model.name, elapsed_s=elapsed, pid=child.pid)
        progress.enter(LoadPhase.READY)
        slot.mark_ready()

    async def _until_answering(self, model: Model, child: Child, timeout_s: float) -> str | None:
        """None once the new process answers its probe; else why it never will."""
        answering = asyncio.create_task(answers_within(self.session, model.config, timeout_s))
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
        return f"not answering within load_timeout_s = {model.config.load_timeout_s:g} s"

    def _load_failed(self, model: Model, cause: str, elapsed_s: float) -> None:
        slot = model.slot
        backoff = model.backoff_s
        model.backoff_s = min(backoff * 2, LOAD_BACKOFF_MAX_S)
        log.warning("slot.load_failed", slot=model.name, reason=cause, elapsed_s=elapsed_s,
                    retry_in_s=backoff)
        if slot.state is SlotState.STARTING:
            if slot.in_flight:
                slot.mark_error(f"load failed: {cause}")
            else:
                slot.transition(SlotState.STOPPED, f"load failed: {cause}")
        slot.fail_load(cause, backoff)

    @contextlib.asynccontextmanager
    async def _turn(self, model: Model, progress: _Progress) -> AsyncIterator[None]:
        """The group's turn for this load, with room made for it; no group, no wait."""
        group = self.groups.get(model.config.group or "")
        if group is None:
            yield
            return
        progress.enter(LoadPhase.WAITING_FOR_ROOM)
        async with group.lock:
            await self._make_room(group, model.config)
            yield

    @contextlib.asynccontextmanager
    async def room_for(self, config: SlotConfig) -> AsyncIterator[None]:
        """The group's turn for an `always` slot a reload is about to start, with the on-demand
        slots it would not fit beside unloaded first; the caller marks it starting inside, so
        no load of the group slips in between. When no room can be made it starts anyway: the
        config check made sure the group's `always` slots fit together."""
        group = self.groups.get(config.group or "")
        if group is None:
            yield
            return
        async with group.lock:
            with contextlib.suppress(NoRoom):
                await self._make_room(group, config)
            yield

    async def _make_room(self, group: Group, config: SlotConfig) -> None:
        limits = group.config
        need = config.memory_mib or 0
        while True:
            loaded = [slot for slot in self._members(group) if slot.name != config.name
                      and slot.state in LOADED]
            used = sum(self._memory(slot.name) for slot in loaded)
            short = None
            if limits.max_loaded is not None and len(loaded) + 1 > limits.max_loaded:
                short = f"{len(loaded)} of max_loaded = {limits.max_loaded} loaded"
            elif limits.memory_mib is not None and used + need > limits.memory_mib:
                short = f"{used} of {limits.memory_mib} MiB in use, {need} MiB needed"
            elif limits.free_memory_command is not None:
                free = await free_memory_mib(limits)
                if free is not None and free < need:
                    short = f"{free} MiB free by free_memory_command, {need} MiB needed"
            if short is None:
                return
            stopping = [slot for slot in loaded if slot.state is SlotState.STOPPING]
            if stopping:
                await self._until_stopped(stopping[0].name)
                continue
            victim = self._victim(loaded)
            if victim is None:
                raise NoRoom(f"no room in group {limits.name!r}: {short}, and nothing can be "
                             "unloaded (the other slots are start = 'always')")
            log.info("slot.evicting", slot=victim.name, group=limits.name, **{"for": config.name},
                     in_flight=victim.slot.in_flight, why=short)
            await self.unload(victim.name, UnloadReason.EVICTED)

    def _members(self, group: Group) -> list[Slot]:
        return [self.table[name] for name, config in self.configs.items()
                if config.group == group.config.name and name in self.table]

    def _memory(self, name: str) -> int:
        return self.configs[name].memory_mib or 0

    def _victim(self, loaded: list[Slot]) -> Model | None:
        """The least recently used loaded on-demand slot, one with nothing in flight first."""
        candidates = [self.models[slot.name] for slot in loaded if slot.name in self.models
                      and slot.state in (SlotState.READY, SlotState.SERVING, SlotState.ERROR)]
        if not candidates:
            return None
        return min(candidates, key=lambda m: (m.slot.in_flight > 0, m.last_used))

    async def _until_stopped(self, name: str) -> None:
        task = self.models[name].unload_task
        if task is not None:
            await asyncio.shield(task)

    # -- unloading ---------------------------------------------------------------------------

    def unload_soon(self, name: str, reason: UnloadReason) -> asyncio.Task[None]:
        model = self.models[name]
        if model.unload_task is None or model.unload_task.done():
            model.unload_task = asyncio.create_task(self._unload(model, reason))
        return model.unload_task

    async def unload(self, name: str, reason: UnloadReason, *, force: bool = False) -> None:
        """Drains the slot (nothing new admitted, in-flight requests run to their end; with
        `force`, they are ended with their surface's terminal frame and the queued get a 503),
        then stops its process; returns once the process is gone."""
        model = self.models[name]
        if force:
            ended = self.end_streams(name, "unloaded")
            model.slot.fail_waiters(SlotLoading(f"slot {name!r} was unloaded",
                                                retry_after=FORCED_RETRY_AFTER_S))
            log.info("slot.unload_forced", slot=name, streams_ended=ended)
        await asyncio.shield(self.unload_soon(name, reason))

    async def _unload(self, model: Model, reason: UnloadReason) -> None:
        slot = model.slot
        if model.load_task is not None and not model.load_task.done():
            model.load_task.cancel()  # its cancellation stops the process and the slot
            await asyncio.gather(model.load_task, return_exceptions=True)
        if slot.state in (SlotState.STOPPED, SlotState.OFFLINE):
            self.load_if_wanted(slot)
            return
        model.cancel_idle_timer()
        slot.transition(SlotState.STOPPING, f"unloading ({reason})")
        if slot.in_flight:
            log.info("slot.draining", slot=model.name, in_flight=slot.in_flight, reason=str(reason))
        await slot.drained()
        child, model.child = model.child, None
        if model.watch_task is not None:
            model.watch_task.cancel()
        if child is not None:
            await child.stop()
        loaded_s = round(time.monotonic() - model.loaded_at, 1) if model.loaded_at else None
        model.loaded_at = None
        if slot.state is SlotState.STOPPING:
            slot.transition(SlotState.STOPPED, f"unloaded ({reason})")
        log.info("slot.unloaded", slot=model.name, reason=str(reason), loaded_s=loaded_s)
        for observer in self.observers:
            observer.unloaded(model.name, reason, loaded_s)
        self.load_if_wanted(slot)

    def load_if_wanted(self, slot: Slot) -> None:
        """Requests that arrived while the slot unloaded load it again, in their turn."""
        if slot.queued and not self._stopping:
            self._wants_load(slot)

    async def _watch(self, model: Model, child: Child) -> None:
        """A process that exits on its own: `stopped` when idle, loaded again when wanted."""
        code = await child.wait()
        if model.child is not child or self._stopping:
            return  # an unload stopped it
        model.child, model.loaded_at = None, None
        slot = model.slot
        cause = child.exit_summary(code)
        log.warning("slot.process_exited", slot=model.name, code=code, reason=cause,
                    in_flight=slot.in_flight, queued=slot.queued)
        if slot.state not in (SlotState.READY, SlotState.SERVING, SlotState.ERROR):
            return
        if not slot.in_flight and not slot.queued:
            slot.transition(SlotState.STOPPED, cause)
            return
        slot.mark_error(cause)
        model.load_task = asyncio.create_task(self._reload_wanted(model))

    async def _reload_wanted(self, model: Model) -> None:
        """Requests are waiting for a process that died: once the ones in flight have failed,
        load it again for the queued ones."""
        await model.slot.drained()
        slot = model.slot
        if slot.state is SlotState.ERROR and not self._stopping:
            slot.transition(SlotState.STOPPING, "the process exited; loading it again")
            slot.transition(SlotState.STOPPED, "the process exited")
            if slot.queued:
                model.load_task = None
                self._wants_load(slot)

    # -- the whole set -----------------------------------------------------------------------

    def set_groups(self, groups: dict[str, GroupConfig]) -> None:
        """A reload's [groups]; a group whose limits changed keeps its turn order."""
        kept = {name: self.groups[name] for name in groups if name in self.groups}
        for name, config in groups.items():
            kept.setdefault(name, Group(config)).config = config
        self.groups = kept

    def reconfigure(self, config: SlotConfig) -> None:
        """A reload's config for a slot (an `always` one only counts in its group). A changed
        idle_unload_s applies to the wait already running, counted from the slot's last use."""
        self.configs[config.name] = config
        model = self.models.get(config.name)
        if model is None:
            return
        idle_before = model.config.idle_unload_s
        model.config = config
        if idle_before != config.idle_unload_s and model.slot.state is SlotState.READY:
            model.cancel_idle_timer()
            if config.idle_unload_s > 0:
                left_s = config.idle_unload_s - (time.monotonic() - model.last_used)
                model.idle_timer = asyncio.get_running_loop().call_later(
                    max(0.0, left_s), self._idle, model)

    def retire(self, name: str) -> Model | None:
        """A slot a reload removed or turned `always`: forgotten here; the caller drains it and
        stops its process with `stop_model`."""
        self.configs.pop(name, None)
        model = self.models.pop(name, None)
        if model is not None:
            model.cancel_idle_timer()
            model.slot.wants_load = None
            with contextlib.suppress(ValueError):
                model.slot.watchers.remove(self._on_change)
        return model

    async def stop_model(self, model: Model, reason: UnloadReason | None = None) -> None:
        """Stops whatever the model is doing and its process, at once (no drain, no state)."""
        model.cancel_idle_timer()
        loaded = model.child is not None
        for task in (model.unload_task, model.load_task, model.watch_task):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        child, model.child = model.child, None
        if child is not None:
            await child.stop()
        if loaded and reason is not None:
            log.info("slot.unloaded", slot=model.name, reason=str(reason))
            for observer in self.observers:
                observer.unloaded(model.name, reason, None)

    async def stop(self) -> None:
        """hal0d is stopping: every loaded model's process is stopped (the server's shutdown
        drained or ended the streams first)."""
        self._stopping = True
        await asyncio.gather(*(self.stop_model(model, UnloadReason.SHUTDOWN)
                               for model in self.models.values()))

    def snapshot(self, name: str) -> dict[str, object]:
        """The lifecycle figures of /api/slots for an on-demand slot."""
        model = self.models[name]
        now = time.monotonic()
        idle_unload_in = None
        if model.slot.state is SlotState.READY and model.config.idle_unload_s > 0:
            idle_unload_in = max(0.0, model.config.idle_unload_s - (now - model.last_used))
        return {
            "start": model.config.start,
            "loaded_for_s": round(now - model.loaded_at, 1) if model.loaded_at else None,
            "idle_for_s": round(now - model.last_used, 1)
            if model.slot.state is SlotState.READY else None,
            "idle_unload_in_s": None if idle_unload_in is None else round(idle_unload_in, 1),
            "pid": model.child.pid if model.child else None,
        }
