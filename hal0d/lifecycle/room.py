"""Room on a group's device, decided: from a snapshot of the group's members, what a load is to do
next. Pure: no asyncio, no clock of its own (the caller passes `now`), no call back into anyone;
the lifecycle manager carries each decision out (load_jobs.py) and asks again.

The rules (groups.py's docstring tells them as a user sees them):

    room         the group's limits hold with the load beside what occupies the device
    settle       a member that is starting or stopping with a job under way frees room or
                 becomes a victim: wait for that job, never answer "no room" meanwhile
    refuse       nothing the group holds can be unloaded (no member, or `always` ones), or the
                 model's own last load failed: NoRoom with why
    evict        a victim (the least recently used idle on-demand member first); with batch,
                 once its turn is over (`not_yet`)

A load's measured time is the median of its slot's last loads (runner.py measures them); before
a slot's first, its turn is `max_wait_s` alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from hal0d.config import GroupConfig
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import EVICTABLE, LOADED, SwapPhase

# A model whose last request ended this recently is not yet without work: a client sending its
# requests one after another comes back within milliseconds, and unloading the model in that gap
# would cost its whole load for nothing (batch only).
IDLE_GRACE_S: Final = 0.25


class NoRoom(Exception):
    """The group cannot make room for a load: the cause is the load's failure."""


class Withdrawn(Exception):
    """Every request that wanted the load left while it waited for a batch to end."""


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


# -- the decisions ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Room:
    """The load fits: go on."""


@dataclass(frozen=True, slots=True)
class Settle:
    """Wait for this member's job (a start or a stop) to end, then ask again."""

    slot: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Unload `victim` (for batch, once `not_yet` says its turn is over), then ask again."""

    victim: Member
    short: str  # what the group lacks without the unload


Decision = Room | Settle | Evict


def decide(limits: GroupConfig, loading: str, occupying: list[Member], short: str | None, *,
           failed: str | None) -> Decision:
    """What the load of `loading` does next, given the members that occupy the device (not it)
    and what the group lacks beside them (`short`, None: nothing). `failed`: why its own last
    load failed, when it did: it then unloads no other model. NoRoom when room can never be
    made for it."""
    if short is None:
        return Room()
    # A member that is stopping, or starting (a replace's old process draining, say), frees
    # room or settles into a victim: waited for, never a "no room".
    settling = next((m for m in occupying if m.settling and m.slot.state not in EVICTABLE), None)
    if settling is not None:
        return Settle(settling.slot.name)
    victim = choose_victim(occupying, limits)
    if victim is None:
        others = ("no other slot of the group is loaded" if not occupying else
                  "the loaded ones are start = 'always', never unloaded")
        raise NoRoom(f"no room in group {limits.name!r}: {short}; {others}")
    if failed is not None:
        raise NoRoom(f"its last load failed ({failed}); no model is unloaded for it "
                     f"again ({short}) until its config changes or an operator loads it")
    return Evict(victim, short)


def shortfall(limits: GroupConfig, occupying: list[Member], need: int) -> str | None:
    """What the group's static limits lack for a load needing `need` MiB beside `occupying`;
    None: room (free_memory_command is the caller's to ask: it runs a program)."""
    used = sum(m.memory_mib for m in occupying)
    if limits.max_loaded is not None and len(occupying) + 1 > limits.max_loaded:
        return f"{len(occupying)} of max_loaded = {limits.max_loaded} loaded"
    if limits.memory_mib is not None and used + need > limits.memory_mib:
        return f"{used} of {limits.memory_mib} MiB in use, {need} MiB needed"
    return None


def choose_victim(occupying: list[Member], limits: GroupConfig) -> Member | None:
    """The least recently used loaded on-demand slot, one with nothing in flight first
    (batch: one with no work, nothing queued or in flight, first; of those with work, the
    one whose turn ends first)."""
    candidates = [m for m in occupying if m.evictable and m.slot.state in EVICTABLE]
    if not candidates:
        return None
    if limits.batch:
        return min(candidates, key=lambda m: (
            busy(m.slot), (turn_ends(limits, m) or 0.0) if busy(m.slot) else 0.0,
            m.last_used))
    return min(candidates, key=lambda m: (m.slot.in_flight > 0, m.last_used))


# -- batch: when a busy victim's turn is over --------------------------------------------------


def busy(slot: Slot) -> bool:
    """Whether a loaded slot has work a batch lets it finish: requests queued or in flight."""
    return bool(slot.queued or slot.in_flight)


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


def not_yet(limits: GroupConfig, me: Slot, victim: Member, now: float) -> float | None:
    """Batch: None when `victim` is to go now for `me`; else when to look again (monotonic).
    With work it goes once the oldest request for `me` has waited max_wait_s and its own
    turn paid for its load (turn_ends); with no work at once (IDLE_GRACE_S after its last
    request ended). Withdrawn when nothing waits for `me`."""
    since = me.oldest_waiting_since()
    if since is None and not me.in_flight:
        raise Withdrawn(f"no request waits for slot {me.name!r} any more")
    deadline = turn_over(limits, since or now, victim)
    if not busy(victim.slot):  # a gap between two requests of its turn is not the end
        deadline = min(deadline, victim.last_used + IDLE_GRACE_S)
    return deadline if now < deadline else None


def pending(limits: GroupConfig, me: Slot, victim: Member, now: float) -> PendingSwap:
    """The swap that waits, as /api/slots shows it: when `me`'s turn comes if `victim` keeps
    its work."""
    since = me.oldest_waiting_since() or now
    turn_at_s = turn_over(limits, since, victim) - since
    return PendingSwap(me.name, victim.slot.name, since, limits.max_wait_s,
                       round(max(0.0, turn_at_s), 1))


def batch_why(limits: GroupConfig, me: Slot, victim: Member, now: float) -> str:
    """Why batch lets `victim` go for `me` now: its turn is over, or it has no work. A victim
    whose turn is over may be between two requests at this instant: its turn ended it, not
    that gap."""
    since = me.oldest_waiting_since()
    over = busy(victim.slot) or (since is not None and now >= turn_over(limits, since, victim))
    if not over:
        return f"; {victim.slot.name} has nothing queued or in flight"
    why = f"; the oldest request for {me.name} waited max_wait_s"
    if turn_ends(limits, victim) is not None:
        why += (f" and {victim.slot.name}'s turn paid for its load "
                f"({limits.min_turn_loads:g} x {victim.load_s:g} s)")
    return why


def planned_why(limits: GroupConfig, me: Slot, victim: Member, turn_at_s: float) -> str:
    return (f"{victim.slot.name} has work: swapping once {me.name}'s oldest request waited "
            f"{turn_at_s:g} s (max_wait_s = {limits.max_wait_s:g} s, min_turn_loads = "
            f"{limits.min_turn_loads:g})")


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
