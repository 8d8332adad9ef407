"""Room on the devices, decided without a clock or a socket (lifecycle/device_room.py): what a
load does on a read of two 24 GiB GPUs with the models that hold them: go (on one device, or
split), never (more than the devices hold), evict the set that is cheapest to load again, wait
for a busy model's turn, or find the devices crowded by what hal0d may not unload."""

from __future__ import annotations

import pytest

from hal0d.config import SlotConfig
from hal0d.devices.placement import Margins
from hal0d.devices.reading import DeviceMemory, ProcessMemory, Reading
from hal0d.lifecycle import device_room
from hal0d.lifecycle.device_room import (
    Crowded,
    EvictSet,
    Go,
    Holder,
    Load,
    Never,
    SettleDevices,
    WaitTurns,
    decide,
)
from hal0d.lifecycle.room import Member
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import SlotState

GIB = 1024
MARGINS = Margins(512)


def holder(name: str, held: dict[int, int], cost: float = 1.0, *,
           state: SlotState = SlotState.READY, may_go_at: float | None = None,
           on_demand: bool = True, settling: bool = False) -> Holder:
    slot = Slot(SlotConfig(name=name, upstream="http://127.0.0.1:1", models=(name,),
                           command=("x",), start="on_demand" if on_demand else "always"),
                state=state)
    member = Member(slot, sum(held.values()), evictable=on_demand, last_used=0.0,
                    settling=settling)
    return Holder(member, held, cost, may_go_at)


def box(holders: list[Holder], other: dict[int, int] | None = None) -> Reading:
    """Two 24 GiB GPUs holding what `holders` hold and `other` programs' MiB."""
    devices = []
    for index in (0, 1):
        processes = tuple(ProcessMemory(100 + n, h.held[index], h.member.slot.name)
                          for n, h in enumerate(holders) if index in h.held)
        used = sum(p.used_mib for p in processes) + (other or {}).get(index, 0)
        devices.append(DeviceMemory(index, f"sim-{index}", 24 * GIB, used, processes))
    return Reading("command", tuple(devices), read_at=1.0)


def test_a_load_that_fits_goes_and_one_no_device_holds_is_split() -> None:
    holders = [holder("a", {0: 12 * GIB}), holder("b", {1: 12 * GIB})]
    fits = decide(Load("c", 8 * GIB), box(holders), MARGINS, holders, now=10.0)
    assert isinstance(fits, Go) and fits.placement is not None
    assert fits.placement.devices == (0,)  # equal free: the lower index
    split = decide(Load("big", 30 * GIB), box([]), MARGINS, [], now=10.0)
    assert isinstance(split, Go) and split.placement is not None
    assert split.placement.devices == (0, 1) and sum(split.placement.shares_mib) == 30 * GIB
    nothing = decide(Load("c", 8 * GIB), Reading(None), MARGINS, [], now=10.0)
    assert nothing == Go(None)


def test_a_load_bigger_than_the_devices_is_never_made_room_for() -> None:
    holders = [holder("a", {0: 4 * GIB})]
    never = decide(Load("huge", 60 * GIB), box(holders), MARGINS, holders, now=10.0)
    assert isinstance(never, Never)
    assert never.why == ("huge needs 61440 MiB and its devices hold at most 48128 MiB, each "
                         "emptied to its margin (device 0: 24576 MiB, device 1: 24576 MiB)")
    pinned = decide(Load("mid", 30 * GIB, allowed=(1,)), box([]), MARGINS, [], now=10.0)
    assert isinstance(pinned, Never)  # one device of its own: 24064 MiB at most


def test_the_set_cheapest_to_load_again_is_unloaded() -> None:
    # 20 GiB wanted; device 0 holds a (8, cost 5) and b (8, cost 1); device 1 holds c (20,
    # cost 3). Unloading b alone is not enough (16 GiB free less the margin); a + b cost 6,
    # c costs 3: c goes.
    holders = [holder("a", {0: 8 * GIB}, 5.0), holder("b", {0: 8 * GIB}, 1.0),
               holder("c", {1: 20 * GIB}, 3.0)]
    evict = decide(Load("d", 20 * GIB), box(holders), MARGINS, holders, now=10.0)
    assert isinstance(evict, EvictSet)
    assert [h.member.slot.name for h in evict.victims] == ["c"]
    assert "unloading c (20480 MiB)" in evict.why
    # c grown dear: a and b together are cheaper than it.
    holders[2] = holder("c", {1: 20 * GIB}, 9.0)
    evict = decide(Load("d", 20 * GIB), box(holders), MARGINS, holders, now=10.0)
    assert isinstance(evict, EvictSet)
    assert sorted(h.member.slot.name for h in evict.victims) == ["a", "b"]


def test_a_busy_model_is_waited_for_and_an_always_one_or_another_program_never_unloaded() -> None:
    busy = [holder("a", {0: 20 * GIB}, state=SlotState.SERVING, may_go_at=42.0),
            holder("b", {1: 20 * GIB}, state=SlotState.SERVING, may_go_at=40.0)]
    wait = decide(Load("d", 12 * GIB), box(busy), MARGINS, busy, now=10.0)
    assert isinstance(wait, WaitTurns) and wait.until == 40.0 and wait.victims == ("b",)
    pinned = [holder("a", {0: 20 * GIB}, on_demand=False), holder("b", {1: 20 * GIB},
                                                                  on_demand=False)]
    crowded = decide(Load("d", 12 * GIB), box(pinned), MARGINS, pinned, now=10.0)
    assert isinstance(crowded, Crowded) and crowded.fallback is not None
    assert "no model hal0d may unload frees enough" in crowded.why
    desktop = decide(Load("d", 12 * GIB), box([], {0: 20 * GIB, 1: 20 * GIB}), MARGINS, [],
                     now=10.0)
    assert isinstance(desktop, Crowded)
    idle = [holder("a", {0: 20 * GIB})]
    failed = decide(Load("d", 12 * GIB, allowed=(0,), may_evict=False), box(idle), MARGINS,
                    idle, now=10.0)
    assert isinstance(failed, Crowded) and "its own last load failed" in failed.why


def test_a_model_that_is_stopping_is_waited_for_before_anything_else_is_unloaded() -> None:
    holders = [holder("a", {0: 20 * GIB}, state=SlotState.STOPPING, settling=True),
               holder("b", {1: 20 * GIB})]
    assert decide(Load("d", 12 * GIB), box(holders), MARGINS, holders,
                  now=10.0) == SettleDevices("a")


@pytest.mark.parametrize(("load_s", "uses", "idle_s", "cost"), [
    (2.0, 0, 0.0, 2.0),       # a load, nothing more
    (2.0, 3, 0.0, 8.0),       # used four times as likely again
    (2.0, 3, 300.0, 4.0),     # ... five minutes ago: half as likely
    (10.0, 0, 2700.0, 1.0),   # a slow load idle for 45 minutes
])
def test_a_models_price_is_its_reload_weighed_by_its_use(
        load_s: float, uses: int, idle_s: float, cost: float) -> None:
    assert device_room.reload_cost(load_s, uses, idle_s) == pytest.approx(cost)
