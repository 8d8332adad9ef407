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

A busy model's turn is priced by what a swap of its group costs, measured whole (`Pricing`):
long enough that swapping takes at most the group's `max_swap_share` of its time. A load's
measured time is the median of its slot's last loads (runner.py measures them).
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
    max_wait_s: float | None


@dataclass(frozen=True, slots=True)
class PendingSwap:
    """A load waiting for a busy model's batch to end, as /api/slots shows it."""

    slot: str
    victim: str
    since: float  # monotonic: when the oldest waiting request came
    max_wait_s: float | None
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
    one that answered first: its turn ends first)."""
    candidates = [m for m in occupying if m.evictable and m.slot.state in EVICTABLE]
    if not candidates:
        return None
    if limits.batch:
        return min(candidates, key=lambda m: (
            busy(m.slot), (m.loaded_at or 0.0) if busy(m.slot) else 0.0, m.last_used))
    return min(candidates, key=lambda m: (m.slot.in_flight > 0, m.last_used))


# -- batch: when a busy victim's turn is over --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pricing:
    """What a busy model's turn is in a group: long enough that the swaps it pays for take at
    most `max_swap_share` of the group's time. A swap costs `cost_s` (its victim's save and
    stop, the load, the restore: groups.SwapClock), and a model's turn counts from its load's
    answer; so a cycle of one model, its swap and its turn, lasts cost_s / share, of which
    cost_s swapping. Before a swap of the group was measured, a swap is taken to cost a load."""

    limits: GroupConfig
    cost_s: float | None = None  # the group's measured swap cost; None before the first

    def swap_s(self, load_s: float | None) -> float:
        """What a swap costs, for a model that loads in `load_s` (None: not measured yet)."""
        if self.cost_s is not None:
            return self.cost_s
        return load_s if load_s is not None else UNMEASURED_SWAP_S

    def turn_s(self, load_s: float | None) -> float:
        """How long a busy model that loads in `load_s` keeps the group once it answered: the
        swap's price, and at least `min_turn_loads` of its own load."""
        share = self.limits.max_swap_share
        turn = self.swap_s(load_s) * (1.0 - share) / share
        if load_s is not None:
            turn = max(turn, self.limits.min_turn_loads * load_s)
        return turn


# A swap's cost before anything of the group was measured (a model's first load is measured
# before any swap, so this prices only a turn of a model hal0d did not load itself).
UNMEASURED_SWAP_S: Final = 1.0


def busy(slot: Slot) -> bool:
    """Whether a loaded slot has work a batch lets it finish: requests queued or in flight."""
    return bool(slot.queued or slot.in_flight)


def turn_ends(pricing: Pricing, member: Member) -> float | None:
    """When a loaded member's turn is over (monotonic): its priced turn after it answered; None
    when it is not loaded."""
    if member.loaded_at is None:
        return None
    return member.loaded_at + pricing.turn_s(member.load_s)


def turn_over(pricing: Pricing, since: float, victim: Member) -> float:
    """When a busy `victim` is to go for a model whose oldest request came at `since`
    (monotonic): once its turn is over, or once that request waited `max_wait_s` when it is
    set, whichever comes first."""
    ends = turn_ends(pricing, victim)
    deadline = since if ends is None else ends
    if pricing.limits.max_wait_s is not None:
        deadline = min(deadline, since + pricing.limits.max_wait_s)
    return deadline


def held_for_interactive(me: Slot, victim: Slot, now: float) -> float | None:
    """Classes (hal0d/shares): when `me` has batch work alone and `victim` interactive work
    queued or in flight, `victim` stays; when to look again (`me`'s batch work past its bound
    goes first, monotonic). None when the classes do not hold `victim`."""
    if me.urgent(now) or not victim.urgent(now):
        return None
    return me.overdue_at() or now + IDLE_GRACE_S


def preempts(me: Slot, victim: Slot, now: float) -> bool:
    """Classes: `me` has interactive work and `victim` batch work alone: its turn ends now (its
    requests in flight finish first)."""
    return busy(victim) and me.urgent(now) and not victim.urgent(now)


def not_yet(pricing: Pricing, me: Slot, victim: Member, now: float) -> float | None:
    """None when `victim` is to go now for `me`; else when to look again (monotonic). The
    classes first: batch work never swaps out a model with interactive work, interactive work
    ends a batch's turn. Then, batch policy: with work it goes once its turn is over
    (turn_over); with no work at once (IDLE_GRACE_S after its last request ended). Withdrawn
    when nothing waits for `me`."""
    since = me.oldest_waiting_since()
    if since is None and not me.in_flight:
        raise Withdrawn(f"no request waits for slot {me.name!r} any more")
    if (held := held_for_interactive(me, victim.slot, now)) is not None:
        return held
    if not pricing.limits.batch or preempts(me, victim.slot, now):
        return None
    deadline = turn_over(pricing, since or now, victim)
    if not busy(victim.slot):  # a gap between two requests of its turn is not the end
        deadline = min(deadline, victim.last_used + IDLE_GRACE_S)
    return deadline if now < deadline else None


def pending(pricing: Pricing, me: Slot, victim: Member, now: float) -> PendingSwap:
    """The swap that waits, as /api/slots shows it: when `me`'s turn comes if `victim` keeps
    its work."""
    since = me.oldest_waiting_since() or now
    turn_at_s = turn_over(pricing, since, victim) - since
    return PendingSwap(me.name, victim.slot.name, since, pricing.limits.max_wait_s,
                       round(max(0.0, turn_at_s), 1))


def batch_why(pricing: Pricing, me: Slot, victim: Member, now: float) -> str:
    """Why batch lets `victim` go for `me` now: its turn is over, `me`'s oldest request waited
    max_wait_s, or it has no work. A victim whose turn is over may be between two requests at
    this instant: its turn ended it, not that gap."""
    if preempts(me, victim.slot, now):
        return f"; {me.name} has interactive work, {victim.slot.name} batch work alone"
    if not pricing.limits.batch:
        return ""
    since = me.oldest_waiting_since()
    ends = turn_ends(pricing, victim)
    turn_done = ends is None or now >= ends
    if not busy(victim.slot) and not (since is not None and turn_done):
        return f"; {victim.slot.name} has nothing queued or in flight"
    if not turn_done:
        return f"; the oldest request for {me.name} waited max_wait_s"
    return f"; {victim.slot.name}'s turn is over ({turn_words(pricing, victim.load_s)})"


def turn_words(pricing: Pricing, load_s: float | None) -> str:
    """A turn's length and what priced it, for the log and the swap's why."""
    cost = pricing.swap_s(load_s)
    measured = "measured" if pricing.cost_s is not None else "a load, none measured yet"
    return (f"{pricing.turn_s(load_s):.1f} s, a swap costing {cost:.2f} s ({measured}) at "
            f"most {pricing.limits.max_swap_share:.0%} of the time")


def planned_why(pricing: Pricing, me: Slot, victim: Member, turn_at_s: float,
                now: float) -> str:
    if held_for_interactive(me, victim.slot, now) is not None:
        return (f"{victim.slot.name} has interactive work and {me.name} batch work alone: "
                f"swapping once it has none, or once {me.name}'s batch work waited "
                "batch_max_wait_s")
    cap = pricing.limits.max_wait_s
    return (f"{victim.slot.name} has work: swapping when its turn is over, once {me.name}'s "
            f"oldest request waited {turn_at_s:g} s (a turn of "
            f"{turn_words(pricing, victim.load_s)}"
            + (f"; max_wait_s = {cap:g} s)" if cap is not None else ")"))


def wait_bound_s(pricing: Pricing, members: Iterable[Member]) -> float:
    """About the longest a request waits for its model's turn with every on-demand model of the
    group busy: the n - 1 others' cycles, each a swap and, with batch, its turn (at most
    `max_wait_s` when set), by the slowest measured load. fifo has no turns: the loads ahead."""
    on_demand = [m for m in members if m.evictable]
    loads = [m.load_s for m in on_demand if m.load_s is not None]
    load = max(loads) if loads else None
    return round(_others(on_demand) * (pricing.swap_s(load) + _turn(pricing, load)), 1)


def queue_bound_s(pricing: Pricing, members: Iterable[Member]) -> float:
    """What a request waiting for its model's turn adds to its queue's bound (Slot.turn_wait_s):
    the n - 1 others' cycles with each load as long as its load_timeout_s allows beside the
    measured swap. wait_bound_s is what the measured swaps make likely; this is what a load may
    take before it fails, so no request is refused because a load ahead of it was slow."""
    on_demand = [m for m in members if m.evictable]
    loads = [m.load_s for m in on_demand if m.load_s is not None]
    load = max(loads) if loads else None
    longest = max((m.slot.config.load_timeout_s for m in on_demand), default=0.0)
    cycle = longest + pricing.swap_s(load) + _turn(pricing, load)
    return round(_others(on_demand) * cycle, 1)


def _others(on_demand: list[Member]) -> int:
    return max(1, len(on_demand) - 1)


def _turn(pricing: Pricing, load: float | None) -> float:
    """A busy model's turn as a bound counts it: none with fifo; at most max_wait_s."""
    turn = pricing.turn_s(load) if pricing.limits.batch else 0.0
    if pricing.limits.max_wait_s is not None:
        turn = min(turn, pricing.limits.max_wait_s)
    return turn
