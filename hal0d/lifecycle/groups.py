"""Groups: slots that share one device, the room a load needs on it, and when a swap happens.

The loads of a group take turns (one at a time), so two models never load onto one device at
once. While the group's limits would be exceeded (`max_loaded`, the `memory_mib` budget, or less
free memory than the slot needs by `free_memory_command`), a loaded on-demand slot of the group
is unloaded: the least recently used, idle ones first. `start = "always"` slots count against
the limits and are never evicted.

When the unload happens is the group's `policy`:

    fifo    at once: the victim drains what is in flight and goes; its next requests queue and
            load it back in their turn (a swap per request when two models alternate)
    batch   a victim with work (requests queued or in flight) keeps serving it, those that keep
            arriving included, until both the oldest request waiting for the loading model has
            waited `max_wait_s` and the victim has been loaded `min_turn_loads` times its own
            measured load time (its turn pays for its load: with loads long against
            `max_wait_s`, or three models, the waits alone would end every turn after one
            round); a victim with no work goes at once (IDLE_GRACE_S after its last request
            ended: a client sending one request after another is not gone). The next load's
            turn goes to the model whose oldest request has waited longest, so every model gets
            its turn and a request waits at most about (n - 1) x (turn + load) with n models
            busy (`wait_bound_s`, which the slots' queue bounds are given).

A load's measured time is the median of its slot's last loads, from the launch to the first
good probe (runner.py measures them); before a slot's first, its turn is `max_wait_s` alone.

A batch wait is woken by what can end it (the manager pokes the group when a member's state or
counts change) and by one timer at the end of the victim's turn; it never polls. A load
whose requests all left while it waited is withdrawn (`Withdrawn`): nothing is unloaded for
nobody. A load asked for by the API or an `always` slot's start does not wait for a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from hal0d.config import GroupConfig, SlotConfig
from hal0d.lifecycle.process import resolve_program
from hal0d.lifecycle.slots import Slot, SlotState
from hal0d.logs import get_logger

log = get_logger()

FREE_MEMORY_TIMEOUT_S: Final = 10.0
# A model whose last request ended this recently is not yet without work: a client sending its
# requests one after another comes back within milliseconds, and unloading the model in that gap
# would cost its whole load for nothing (batch only).
IDLE_GRACE_S: Final = 0.25
# The states in which a slot's process is alive (or being started): it occupies its device.
LOADED: Final = frozenset({
    SlotState.STARTING, SlotState.READY, SlotState.SERVING, SlotState.ERROR, SlotState.STOPPING,
})
# The states a victim may be unloaded from.
EVICTABLE: Final = frozenset({SlotState.READY, SlotState.SERVING, SlotState.ERROR})


class NoRoom(Exception):
    """The group cannot make room for a load: the cause is the load's failure."""


class Withdrawn(Exception):
    """Every request that wanted the load left while it waited for a batch to end."""


class SwapPhase(enum.StrEnum):
    PLANNED = "planned"  # a load waits for room that a busy model holds (batch: until its turn)
    STARTED = "started"  # the victim is being unloaded (it drains first)
    DONE = "done"  # the victim is gone: the waiting model loads


@dataclass(frozen=True, slots=True)
class Swap:
    """One step of a swap, told to the manager's observers."""

    group: str
    phase: SwapPhase
    slot: str  # the model that waits
    victim: str  # the model that makes room
    waited_s: float  # the waiting model's oldest request, so far
    why: str
    policy: str
    max_wait_s: float


@dataclass(frozen=True, slots=True)
class PendingSwap:
    """A load waiting for a busy model's batch to end, as /api/slots shows it."""

    slot: str
    victim: str
    since: float  # monotonic: when the oldest waiting request came
    max_wait_s: float
    turn_at_s: float  # how long that request will have waited when the victim's turn ends

    def view(self, now: float) -> dict[str, object]:
        waited = max(0.0, now - self.since)
        return {
            "waiting": self.slot, "victim": self.victim,
            "waited_s": round(waited, 1), "max_wait_s": self.max_wait_s,
            "turn_at_s": self.turn_at_s,
            "why": f"waiting for {self.slot}'s turn: {waited:.0f} s of {self.turn_at_s:g}",
        }


@dataclass(eq=False)
class Group:
    """One group's limits, whose turn it is to load, and the swap that waits."""

    config: GroupConfig
    held: bool = False
    # The loads waiting for their turn: (the slot, when it asked, its grant).
    waiting: list[tuple[Slot, float, asyncio.Future[None]]] = field(default_factory=list)
    wake: asyncio.Future[None] | None = None  # the batch wait under way, if any
    pending: PendingSwap | None = None

    async def take_turn(self, slot: Slot) -> None:
        if not self.held and not self.waiting:
            self.held = True
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (slot, time.monotonic(), fut)
        self.waiting.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.give_turn()  # granted in the same instant: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self.waiting.remove(entry)
            raise

    def give_turn(self) -> None:
        """The next load's turn: fifo, the first to ask; batch, the one whose oldest request
        waits longest (a load no request waits for, by when it asked)."""
        self.waiting = [entry for entry in self.waiting if not entry[2].done()]
        if not self.waiting:
            self.held = False
            return
        index = 0
        if self.config.batch:
            index = min(range(len(self.waiting)), key=lambda i: (
                self.waiting[i][0].oldest_waiting_since() or self.waiting[i][1]))
        _, _, fut = self.waiting.pop(index)
        fut.set_result(None)

    def poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)


@dataclass(frozen=True, slots=True)
class Member:
    """What room making needs to know of a slot of the group."""

    slot: Slot
    memory_mib: int
    evictable: bool  # on demand: may be unloaded to make room
    last_used: float
    loaded_at: float | None = None  # monotonic: when its current load answered
    load_s: float | None = None  # its measured load time; None before its first load
    # A job of its process is under way (its start, restore included, or its stop): the room
    # it holds is to be waited for, not counted as held for good.
    settling: bool = False
    # hal0d runs its process and none is running (a start that waits for its turn): it holds
    # no room, whatever its state says.
    without_process: bool = False

    def occupies(self) -> bool:
        """Whether it holds room on the device now."""
        return self.slot.state in LOADED and not self.without_process


def turn_ends(limits: GroupConfig, member: Member) -> float | None:
    """When a loaded member's turn has paid for its load (monotonic): `min_turn_loads` times its
    measured load time after it loaded; None when no such turn holds it (the rule is off, it is
    not loaded, or no load of it was measured yet)."""
    if not limits.min_turn_loads or member.loaded_at is None or member.load_s is None:
        return None
    return member.loaded_at + limits.min_turn_loads * member.load_s


def turn_over(limits: GroupConfig, since: float, victim: Member) -> float:
    """When a busy `victim` is to go for a model whose oldest request came at `since`
    (monotonic): once that request waited max_wait_s and the victim's turn paid for its load."""
    ends = turn_ends(limits, victim)
    return max(since + limits.max_wait_s, ends if ends is not None else since)


def wait_bound_s(limits: GroupConfig, members: Iterable[Member]) -> float:
    """The longest a request waits for its model's turn with every on-demand model of the group
    busy: the n - 1 others' turns (`max_wait_s` or `min_turn_loads` loads, the longer) and
    loads, by the slowest measured load; (n - 1) x `max_wait_s` before any load was measured."""
    on_demand = [m for m in members if m.evictable]
    others = max(1, len(on_demand) - 1)
    loads = [m.load_s for m in on_demand if m.load_s is not None]
    if not loads:
        return others * limits.max_wait_s
    load = max(loads)
    return round(others * (max(limits.max_wait_s, limits.min_turn_loads * load) + load), 1)


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


Members = Callable[[str], Iterable[Member]]
Evict = Callable[[str], Awaitable[None]]
Settled = Callable[[str], Awaitable[None]]
Swapped = Callable[[Swap], None]


class Groups:
    """Every [groups] entry, and the turns and room of their loads."""

    def __init__(self, groups: dict[str, GroupConfig], members: Members, evict: Evict,
                 settled: Settled, swapped: Swapped = lambda swap: None) -> None:
        self.groups = {name: Group(config) for name, config in groups.items()}
        self._members = members  # the slots of a group
        self._evict = evict  # unloads a slot (reason: evicted); returns once its process is gone
        self._settled = settled  # returns once a stopping slot's process is gone
        self._swapped = swapped  # told each step of a swap

    def get(self, name: str | None) -> Group | None:
        return self.groups.get(name or "")

    def turn_wait_s(self, config: SlotConfig) -> float:
        """The longest a request for `config`'s slot may wait for its model's turn when its
        group batches (wait_bound_s), on top of the load's own bound."""
        group = self.get(config.group)
        if group is None or not group.config.batch or not config.on_demand:
            return 0.0
        return wait_bound_s(group.config, self._members(group.config.name))

    def refresh(self, name: str | None) -> None:
        """Every slot of the group given its wait bound anew: a member came, or a load of one
        was measured."""
        group = self.get(name)
        if group is None:
            return
        members = list(self._members(group.config.name))
        bound = wait_bound_s(group.config, members) if group.config.batch else 0.0
        for member in members:
            member.slot.turn_wait_s = bound if member.evictable else 0.0

    def replace(self, groups: dict[str, GroupConfig]) -> None:
        """A reload's [groups]; a group whose limits changed keeps its turn order."""
        kept = {name: self.groups[name] for name in groups if name in self.groups}
        for name, config in groups.items():
            kept.setdefault(name, Group(config)).config = config
        self.groups = kept

    def poke(self, name: str | None) -> None:
        """Something a batch wait may be waiting for changed in the group (a member's state or
        counts)."""
        group = self.get(name)
        if group is not None:
            group.poke()

    @contextlib.asynccontextmanager
    async def turn(self, slot: Slot, config: SlotConfig, *, pinned: bool,
                   urgent: bool = False, evicts_for: str | None = None
                   ) -> AsyncIterator[None]:
        """The group's turn for `config`'s start, with room made for it; no group, no wait.
        A `pinned` (always) slot starts even when no room can be made: the config check made
        sure the group's `always` slots fit together. Otherwise NoRoom says why not. An
        `urgent` load (pinned, or asked for by the API) does not wait for a batch to end;
        another load whose requests all left meanwhile raises Withdrawn. `evicts_for`: why the
        slot's last load failed, when it did: it loads only into room there is, unloading no
        other model for a load that is likely to fail again (NoRoom)."""
        group = self.get(config.group)
        if group is None:
            yield
            return
        await group.take_turn(slot)
        try:
            try:
                await self._make_room(group, slot, config, urgent=urgent or pinned,
                                      failed=None if pinned else evicts_for)
            except NoRoom:
                if not pinned:
                    raise
            yield
        finally:
            group.give_turn()

    async def _make_room(self, group: Group, slot: Slot, config: SlotConfig, *,
                         urgent: bool, failed: str | None = None) -> None:
        need = config.memory_mib or 0
        try:
            await self._room(group, slot, config, need, urgent=urgent, failed=failed)
        finally:
            group.pending = None

    async def _room(self, group: Group, me: Slot, config: SlotConfig, need: int, *,
                    urgent: bool, failed: str | None) -> None:
        limits = group.config
        swapped: Member | None = None
        planned = False
        while True:
            loaded = [m for m in self._members(limits.name) if m.slot.name != config.name
                      and m.occupies()]
            short = await self._short(limits, loaded, need)
            if short is None:
                if swapped is not None:
                    self._tell(group, SwapPhase.DONE, me, swapped, "room made")
                return
            # A member that is stopping, or starting (a replace's old process draining, say),
            # frees room or settles into a victim: waited for, never a "no room".
            settling = [m for m in loaded if m.settling and m.slot.state not in EVICTABLE]
            if settling:
                await self._settled(settling[0].slot.name)
                continue
            victim = self._victim(loaded, limits)
            if victim is None:
                others = ("no other slot of the group is loaded" if not loaded else
                          "the loaded ones are start = 'always', never unloaded")
                raise NoRoom(f"no room in group {limits.name!r}: {short}; {others}")
            if failed is not None:
                log.info("slot.not_evicting", slot=victim.slot.name, group=limits.name,
                         **{"for": config.name}, reason=failed)
                raise NoRoom(f"its last load failed ({failed}); no model is unloaded for it "
                             f"again ({short}) until its config changes or an operator loads "
                             "it")
            if limits.batch and not urgent:
                wake = self._not_yet(limits, me, victim)
                if wake is not None:
                    pending = self._pend(group, me, victim)
                    if not planned:
                        planned = True
                        self._tell(group, SwapPhase.PLANNED, me, victim,
                                   f"{victim.slot.name} has work: swapping once {me.name}'s "
                                   f"oldest request waited {pending.turn_at_s:g} s (max_wait_s "
                                   f"= {limits.max_wait_s:g} s, min_turn_loads = "
                                   f"{limits.min_turn_loads:g})")
                    await self._wait_turn(group, me, victim.slot.name, wake)
                    continue
                group.pending = None
            why = short + (self._batch_why(limits, me, victim) if limits.batch and not urgent
                           else "")
            if not planned:
                self._tell(group, SwapPhase.PLANNED, me, victim, why)
            self._tell(group, SwapPhase.STARTED, me, victim, why)
            log.info("slot.evicting", slot=victim.slot.name, group=limits.name,
                     **{"for": config.name}, in_flight=victim.slot.in_flight,
                     queued=victim.slot.queued, why=why)
            swapped = victim
            await self._evict(victim.slot.name)

    @staticmethod
    def _batch_why(limits: GroupConfig, me: Slot, victim: Member) -> str:
        """Why batch lets `victim` go for `me` now: its turn is over, or it has no work. A victim
        whose turn is over may be between two requests at this instant: its turn ended it, not
        that gap."""
        since = me.oldest_waiting_since()
        over = busy(victim.slot) or (since is not None
                                     and time.monotonic() >= turn_over(limits, since, victim))
        if not over:
            return f"; {victim.slot.name} has nothing queued or in flight"
        why = f"; the oldest request for {me.name} waited max_wait_s"
        if turn_ends(limits, victim) is not None:
            why += (f" and {victim.slot.name}'s turn paid for its load "
                    f"({limits.min_turn_loads:g} x {victim.load_s:g} s)")
        return why

    @staticmethod
    async def _short(limits: GroupConfig, loaded: list[Member], need: int) -> str | None:
        """What the group lacks for a load needing `need` MiB beside `loaded`; None: room."""
        used = sum(m.memory_mib for m in loaded)
        if limits.max_loaded is not None and len(loaded) + 1 > limits.max_loaded:
            return f"{len(loaded)} of max_loaded = {limits.max_loaded} loaded"
        if limits.memory_mib is not None and used + need > limits.memory_mib:
            return f"{used} of {limits.memory_mib} MiB in use, {need} MiB needed"
        if limits.free_memory_command is not None:
            free = await free_memory_mib(limits)
            if free is not None and free < need:
                return f"{free} MiB free by free_memory_command, {need} MiB needed"
        return None

    @staticmethod
    def _not_yet(limits: GroupConfig, me: Slot, victim: Member) -> float | None:
        """Batch: None when `victim` is to go now for `me`; else when to look again (monotonic).
        With work it goes once the oldest request for `me` has waited max_wait_s and its own
        turn paid for its load (turn_ends); with no work at once (IDLE_GRACE_S after its last
        request ended). Withdrawn when nothing waits for `me`."""
        since = me.oldest_waiting_since()
        if since is None and not me.in_flight:
            raise Withdrawn(f"no request waits for slot {me.name!r} any more")
        now = time.monotonic()
        deadline = turn_over(limits, since or now, victim)
        if not busy(victim.slot):  # a gap between two requests of its turn is not the end
            deadline = min(deadline, victim.last_used + IDLE_GRACE_S)
        return deadline if now < deadline else None

    @staticmethod
    def _pend(group: Group, me: Slot, victim: Member) -> PendingSwap:
        """The swap that waits, as /api/slots shows it: when `me`'s turn comes if `victim`
        keeps its work."""
        since = me.oldest_waiting_since() or time.monotonic()
        turn_at_s = turn_over(group.config, since, victim) - since
        group.pending = PendingSwap(me.name, victim.slot.name, since, group.config.max_wait_s,
                                    round(max(0.0, turn_at_s), 1))
        return group.pending

    def _tell(self, group: Group, phase: SwapPhase, me: Slot, victim: Member, why: str) -> None:
        since = me.oldest_waiting_since()
        waited = 0.0 if since is None else round(time.monotonic() - since, 3)
        limits = group.config
        self._swapped(Swap(limits.name, phase, me.name, victim.slot.name, waited, why,
                           limits.policy, limits.max_wait_s))

    async def _wait_turn(self, group: Group, me: Slot, victim: str, wake: float) -> None:
        """Until `victim` is to go for `me` (or is no longer evictable): the batch's end. Only
        the batch rule is looked at again on each wake (a busy victim's counts change with every
        request); the room, free_memory_command's included, once the wait is over."""
        limits = group.config
        next_wake: float | None = wake
        while next_wake is not None:
            await self._until(group, next_wake)
            member = next((m for m in self._members(limits.name) if m.slot.name == victim), None)
            if member is None or member.slot.state not in EVICTABLE:
                return
            next_wake = self._not_yet(limits, me, member)
            if next_wake is not None:
                self._pend(group, me, member)

    @staticmethod
    async def _until(group: Group, deadline: float) -> None:
        """Until something changed in the group (poke) or `deadline` (monotonic)."""
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        group.wake = wake
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), group.poke)
        try:
            await wake
        finally:
            timer.cancel()
            group.wake = None

    @staticmethod
    def _victim(loaded: list[Member], limits: GroupConfig) -> Member | None:
        """The least recently used loaded on-demand slot, one with nothing in flight first
        (batch: one with no work, nothing queued or in flight, first; of those with work, the
        one whose turn ends first)."""
        candidates = [m for m in loaded if m.evictable and m.slot.state in EVICTABLE]
        if not candidates:
            return None
        if limits.batch:
            return min(candidates, key=lambda m: (
                busy(m.slot), (turn_ends(limits, m) or 0.0) if busy(m.slot) else 0.0,
                m.last_used))
        return min(candidates, key=lambda m: (m.slot.in_flight > 0, m.last_used))


def busy(slot: Slot) -> bool:
    """Whether a loaded slot has work a batch lets it finish: requests queued or in flight."""
    return bool(slot.queued or slot.in_flight)
