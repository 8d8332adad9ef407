"""Room on the devices, decided: from one fresh read of the devices and a snapshot of the slots'
models that hold memory there, what a load does next. Pure, as room.py: no asyncio, no clock
of its own, no call back into anyone; the lifecycle manager carries each decision out
(device_jobs.py) and asks again with a new read.

    go       it fits (placement.place: one device, else split over the fewest), or nothing is
             read (no GPU, no devices_command: today's behaviour)
    never    it needs more than the devices it may use hold, each emptied to its margin: it is
             refused at once, with the figures
    settle   a model of hal0d's is stopping: the room it frees is waited for
    evict    the set of models whose unload makes room and whose reload would cost least:
             idle ones, and busy ones whose turn is over (their requests in flight finish
             first: a model in flight is never stopped for room)
    wait     room can only be made by models still busy in their turn: until the turns of the
             set that may go soonest are over (then asked again)
    crowded  no model hal0d may unload frees enough (what holds the devices is other programs,
             `always` slots, or a model whose own last load failed would have to evict): a
             footprint that was measured is refused (NoRoom); one that is only a guess goes to
             the device with the most free memory, and its server's word decides (an out of
             memory is retried once with room made)

A victim's price is what its reload would cost (its measured load time, a swap's before the
first) weighed by how likely it is wanted again soon: how often it was asked for in the last
hour and how recently. Among the sets that make room the cheapest goes; between equals, the
fewer models.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from hal0d.devices.placement import Margins, Placement, anywhere, capacity_mib, place
from hal0d.devices.reading import Reading
from hal0d.lifecycle.room import Member
from hal0d.lifecycle.vocabulary import EVICTABLE, SlotState

# Beyond this many unloadable models the cheapest are tried (2^10 sets, each a placement).
MAX_CANDIDATES: Final = 10
# How long ago a use still makes a model likely to be wanted: its weight halves at this age.
RECENT_S: Final = 300.0


@dataclass(frozen=True, slots=True)
class Holder:
    """A slot's model holding memory on the devices now, as room making sees it."""

    member: Member
    held: Mapping[int, int]  # device index -> MiB its processes hold, from the read
    cost: float  # what unloading it costs: its reload, weighed by its use (reload_cost)
    may_go_at: float | None  # None: may go now; else when its turn is over (monotonic)


def reload_cost(load_s: float, uses_last_hour: int, idle_s: float) -> float:
    """What unloading a model costs: its reload's time, by how often it was used in the last
    hour (each use another chance it is asked for again) and how recently (the weight halves
    every RECENT_S of idleness)."""
    return load_s * (1 + uses_last_hour) * RECENT_S / (RECENT_S + max(0.0, idle_s))


@dataclass(frozen=True, slots=True)
class Go:
    placement: Placement | None  # None: nothing to place on (no devices read)


@dataclass(frozen=True, slots=True)
class Never:
    why: str


@dataclass(frozen=True, slots=True)
class SettleDevices:
    slot: str


@dataclass(frozen=True, slots=True)
class EvictSet:
    victims: tuple[Holder, ...]
    why: str


@dataclass(frozen=True, slots=True)
class WaitTurns:
    until: float  # monotonic: the first of the needed models' turns to end
    victims: tuple[str, ...]
    why: str


@dataclass(frozen=True, slots=True)
class Crowded:
    fallback: Placement | None  # where a load whose footprint is a guess goes anyway
    why: str


DeviceDecision = Go | Never | SettleDevices | EvictSet | WaitTurns | Crowded


@dataclass(frozen=True, slots=True)
class Load:
    """The load room is made for."""

    name: str
    need_mib: int
    preferred: tuple[int, ...] = ()  # where its last process was
    allowed: tuple[int, ...] | None = None  # its slot's `devices`
    may_evict: bool = True  # False: its own last load failed, it unloads nothing


def decide(load: Load, reading: Reading, margins: Margins, holders: Sequence[Holder],
           now: float) -> DeviceDecision:
    """What the load does next (the module's docstring tells the rules)."""
    capacity = capacity_mib(reading, margins, load.allowed)
    if capacity is None:
        return Go(None)
    if load.need_mib > capacity:
        return Never(f"{load.name} needs {load.need_mib} MiB and its devices hold at most "
                     f"{capacity} MiB, each emptied to its margin ({_totals(reading, load)})")
    fits = place(load.need_mib, reading, margins, load.preferred, load.allowed)
    if fits is not None:
        return Go(fits)
    short = _short(load, reading, margins)
    stopping = next((h for h in holders if h.member.settling
                     and h.member.slot.state is SlotState.STOPPING), None)
    if stopping is not None:
        return SettleDevices(stopping.member.slot.name)
    unloadable = [h for h in holders if h.member.evictable and load.may_evict
                  and h.member.slot.state in EVICTABLE]
    now_set = _cheapest(load, reading, margins, [h for h in unloadable if h.may_go_at is None])
    if now_set is not None:
        names = ", ".join(f"{h.member.slot.name} ({sum(h.held.values())} MiB)" for h in now_set)
        return EvictSet(now_set, f"{short}; unloading {names}, the cheapest to load again")
    later = _cheapest(load, reading, margins, unloadable, now)
    if later is not None:
        busy = [h for h in later if h.may_go_at is not None]
        until = min(h.may_go_at for h in busy if h.may_go_at is not None)
        return WaitTurns(until, tuple(h.member.slot.name for h in busy),
                         f"{short}; waiting for the turn of "
                         f"{', '.join(h.member.slot.name for h in busy)} to end")
    others = ("; its own last load failed, so it unloads no other model" if not load.may_evict
              else "; no model hal0d may unload frees enough")
    return Crowded(anywhere(load.need_mib, reading, margins, load.allowed), short + others)


def _cheapest(load: Load, reading: Reading, margins: Margins, candidates: list[Holder],
              now: float | None = None) -> tuple[Holder, ...] | None:
    """The set of `candidates` whose unload lets the load be placed at the least cost (the
    fewer between equals); None when even all of them do not. Given `now`, the set that may
    go soonest comes first (a busy model's turn ends when it ends), then the cost."""
    pool = sorted((h for h in candidates if h.held), key=lambda h: h.cost)[:MAX_CANDIDATES]
    best: tuple[float, float, int, tuple[Holder, ...]] | None = None
    for size in range(1, len(pool) + 1):
        for victims in itertools.combinations(pool, size):
            cost = sum(h.cost for h in victims)
            goes = 0.0 if now is None else max(h.may_go_at or now for h in victims)
            if best is not None and (goes, cost) >= best[:2]:
                continue
            if place(load.need_mib, without(reading, victims), margins, load.preferred,
                     load.allowed) is not None:
                best = (goes, cost, size, victims)
    return best[3] if best is not None else None


def without(reading: Reading, victims: Sequence[Holder]) -> Reading:
    """The read as it would be with `victims` unloaded: their memory free."""
    freed: dict[int, int] = {}
    for victim in victims:
        for index, mib in victim.held.items():
            freed[index] = freed.get(index, 0) + mib
    return dataclasses.replace(reading, devices=tuple(
        dataclasses.replace(device, used_mib=max(0, device.used_mib - freed.get(device.index, 0)))
        for device in reading.devices))


def _short(load: Load, reading: Reading, margins: Margins) -> str:
    free = ", ".join(f"device {d.index}: {d.free_mib} MiB free, {margins.of(d.index)} kept"
                     for d in reading.devices
                     if load.allowed is None or d.index in load.allowed)
    return f"{load.name} needs {load.need_mib} MiB ({free})"


def _totals(reading: Reading, load: Load) -> str:
    return ", ".join(f"device {d.index}: {d.total_mib} MiB" for d in reading.devices
                     if load.allowed is None or d.index in load.allowed)
