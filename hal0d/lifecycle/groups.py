"""Groups: slots that share one device, whose turn it is to load there, and when a swap happens.

The loads of a group take turns (one at a time), so two models never load onto one device at
once. While the group's limits would be exceeded (`max_loaded`, the `memory_mib` budget, or less
free memory than the slot needs by `free_memory_command`), a loaded on-demand slot of the group
is unloaded: the least recently used, idle ones first. `start = "always"` slots count against
the limits and are never evicted.

When the unload happens is the group's `policy`:

    fifo    at once: the victim drains what is in flight and goes; its next requests queue and
            load it back in their turn (a swap per request when two models alternate)
    batch   a victim with work (requests queued or in flight) keeps serving it, those that keep
            arriving included, until its turn is over; a victim with no work goes at once
            (IDLE_GRACE_S after its last request ended: a client sending one request after
            another is not gone). A turn is priced by what a swap of the group costs, measured
            whole (SwapClock: the victim's save and stop, the load, the restore): long enough
            that swapping takes at most `max_swap_share` of the group's time (a turn of 4 swaps
            at the default 20 %), and at least `min_turn_loads` of the model's own load.
            `max_wait_s`, when set, ends a turn once the oldest request for another model waited
            that long. The next load's turn goes to the model whose oldest request has waited
            longest, so every model gets its turn and a request waits at most about
            (n - 1) x (turn + swap) with n models busy (room.wait_bound_s; the slots' queue
            bounds grow by room.queue_bound_s).

Under either policy the keys' classes come first (hal0d/shares, room.held_for_interactive and
room.preempts): batch work never swaps out a model with interactive work queued or in flight,
and interactive work ends a model's turn at once when that model has batch work alone (its
requests in flight finish first). The next load's turn goes to the model whose next request
ranks first (turns.py): batch work past `batch_max_wait_s`, then interactive work, then batch.

What a load does next in its turn is decided in room.py (pure, from a snapshot of the members);
the lifecycle manager carries it out (load_jobs.py). This module holds each group's turn order
and the one wait a batch has: woken by what can end it (the manager pokes the group when a
member's state or counts change) and by one timer at the end of the victim's turn; it never
polls. A load whose requests all left while it waited is withdrawn (`Withdrawn`): nothing is
unloaded for nobody. A load asked for by the API or an `always` slot's start does not wait for a
batch.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import re
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final

from hal0d.config import GroupConfig
from hal0d.lifecycle.room import PendingSwap, Pricing
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.turns import INTERACTIVE
from hal0d.logs import get_logger
from hal0d.programs import ProgramFailed, run_program

log = get_logger()

# The box's own turn where devices are read (device_jobs.py), named as a group is.
DEVICES_GROUP: Final = "devices"
FREE_MEMORY_TIMEOUT_S: Final = 10.0
FREE_MEMORY_OUTPUT: Final = 65536  # nvidia-smi's answer is a line; more is something else
# The share of time spent swapping is shown over the last hour; the cost of a swap is the median
# of the group's last few, so one cold disk does not stand for every swap.
SWAP_WINDOW_S: Final = 3600.0
SWAP_HISTORY: Final = 5


@dataclass(eq=False)
class SwapClock:
    """A group's swaps, each measured whole: from the moment its first victim's requests in
    flight were done (until then they were served, not lost) to the loading model answering
    with its caches restored: the victim's save and stop, the load, the restore."""

    costs: collections.deque[float] = field(
        default_factory=lambda: collections.deque(maxlen=SWAP_HISTORY))
    spans: collections.deque[tuple[float, float]] = field(default_factory=collections.deque)
    started: float = field(default_factory=time.monotonic)  # when the group was first seen
    count: int = 0  # every swap measured since hal0d started

    def swapped(self, began: float, ended: float) -> float:
        """A swap measured; returns its cost."""
        self.count += 1
        self.costs.append(ended - began)
        self.spans.append((began, ended))
        while self.spans and self.spans[0][1] < ended - SWAP_WINDOW_S:
            self.spans.popleft()
        return ended - began

    def cost_s(self) -> float | None:
        """What a swap costs the group: the median of its last swaps; None before the first."""
        return round(statistics.median(self.costs), 3) if self.costs else None

    def share(self, now: float) -> float:
        """The share of the last hour (or of the time since the group was first seen, when
        shorter) that a swap was under way."""
        window = min(SWAP_WINDOW_S, now - self.started)
        if window <= 0:
            return 0.0
        since = now - window
        swapping = sum(max(0.0, min(ended, now) - max(began, since))
                       for began, ended in self.spans)
        return round(min(1.0, swapping / window), 4)


@dataclass(eq=False)
class Group:
    """One group's limits, whose turn it is to load, and the swap that waits."""

    config: GroupConfig
    held: bool = False
    turn_of: Slot | None = None  # the slot whose load has the turn
    # The loads waiting for their turn: (the slot, when it asked, its grant).
    waiting: list[tuple[Slot, float, asyncio.Future[None]]] = field(default_factory=list)
    wake: asyncio.Future[None] | None = None  # the batch wait under way, if any
    pending: PendingSwap | None = None
    clock: SwapClock = field(default_factory=SwapClock)

    def pricing(self) -> Pricing:
        """What a busy model's turn is now, by the swaps measured so far."""
        return Pricing(self.config, self.clock.cost_s())

    def interactive_load(self, other_than: Slot) -> bool:
        """Whether a load of another member with interactive work (turns.py) waits for its
        turn or has it: it comes next, and may unload `other_than`."""
        loads = [slot for slot, _, fut in self.waiting if not fut.done()]
        if self.turn_of is not None:
            loads.append(self.turn_of)
        return any(slot is not other_than and slot.urgent() for slot in loads)

    async def take_turn(self, slot: Slot) -> None:
        if not self.held and not self.waiting:
            self.held, self.turn_of = True, slot
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
        """The next load's turn: the one whose next request ranks first in its queue (turns.py:
        batch work past its bound, then interactive work, then batch work); then, fifo, the
        first to ask; batch, the one whose next request's key used least for its weight, then
        whose oldest request waits longest (a load no request waits for, by when it asked)."""
        self.waiting = [entry for entry in self.waiting if not entry[2].done()]
        if not self.waiting:
            self.held, self.turn_of = False, None
            return
        now = time.monotonic()

        def rank(index: int) -> tuple[float, ...]:
            slot, asked, _ = self.waiting[index]
            tier, used, granted, since = slot.rank(now) or (INTERACTIVE, 0.0, 0.0, asked)
            return (tier, used, granted, since) if self.config.batch else (tier, index)

        self.turn_of, _, fut = self.waiting.pop(min(range(len(self.waiting)), key=rank))
        fut.set_result(None)

    def poke(self) -> None:
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)

    async def until(self, deadline: float) -> None:
        """Until something changed in the group (poke) or `deadline` (monotonic)."""
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        self.wake = wake
        timer = loop.call_later(max(0.0, deadline - time.monotonic()), self.poke)
        try:
            await wake
        finally:
            timer.cancel()
            self.wake = None


async def free_memory_mib(group: GroupConfig) -> int | None:
    """What the group's free_memory_command reports (the first number it prints), or None when
    it cannot be run or read (logged; the load then goes by the static limits alone)."""
    assert group.free_memory_command is not None
    try:
        done = await run_program(group.free_memory_command, timeout_s=FREE_MEMORY_TIMEOUT_S,
                                 max_output=FREE_MEMORY_OUTPUT)
    except ProgramFailed as exc:
        log.warning("group.free_memory_failed", group=group.name, error=str(exc))
        return None
    found = re.search(rb"\d+", done.out)
    if done.code != 0 or found is None:
        log.warning("group.free_memory_failed", group=group.name, code=done.code,
                    output=(done.out or done.err)[:200].decode("utf-8", "replace").strip())
        return None
    return int(found.group())


class Groups:
    """Every [groups] entry, and the turns of their loads."""

    def __init__(self, groups: dict[str, GroupConfig]) -> None:
        self.groups = {name: Group(config) for name, config in groups.items()}
        # Told each load's turn's end (the manager: members that held their grants for it may
        # take their requests now).
        self.on_turn_end: Callable[[str], None] | None = None

    def get(self, name: str | None) -> Group | None:
        return self.groups.get(name or "")

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
    async def turn(self, slot: Slot, group_name: str | None) -> AsyncIterator[Group | None]:
        """The group's turn for `slot`'s load (one load at a time on a device); no group, no
        wait. Yields the group, for the room the load then makes in its turn."""
        group = self.get(group_name)
        if group is None:
            yield None
            return
        await group.take_turn(slot)
        try:
            yield group
        finally:
            group.pending = None
            group.give_turn()
            if self.on_turn_end is not None:
                self.on_turn_end(group.config.name)
