"""The batch rule's arithmetic, without a clock or a socket: a turn priced by the measured cost of
a swap (room.Pricing), the wait bounds it gives, when a busy model goes, and the swaps a group
measured (groups.SwapClock)."""

from __future__ import annotations

import pytest

from hal0d.config import GroupConfig, SlotConfig
from hal0d.lifecycle import room
from hal0d.lifecycle.groups import SwapClock
from hal0d.lifecycle.room import Member, Pricing
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import SlotState


def group(**keys: object) -> GroupConfig:
    return GroupConfig("gpu", max_loaded=1, min_turn_loads=0.0, **keys)  # type: ignore[arg-type]


def member(name: str, *, loaded_at: float | None = 100.0, load_s: float | None = 0.25,
           busy: bool = True, load_timeout_s: float = 60.0) -> Member:
    slot = Slot(SlotConfig(name=name, upstream="http://127.0.0.1:1", models=(name,),
                           command=("x",), start="on_demand", load_timeout_s=load_timeout_s),
                state=SlotState.SERVING if busy else SlotState.READY)
    slot.in_flight = 1 if busy else 0
    return Member(slot, 0, evictable=True, last_used=loaded_at or 0.0, loaded_at=loaded_at,
                  load_s=load_s)


@pytest.mark.parametrize(("share", "cost", "turn"), [
    (0.2, 1.0, 4.0),    # a cycle of 5 s: 1 s of it swapping
    (0.2, 32.0, 128.0),  # 30 s loads: turns of two minutes
    (0.5, 1.0, 1.0),
    (0.1, 2.0, 18.0),
])
def test_a_turn_keeps_swapping_at_the_groups_share_of_a_cycle(
        share: float, cost: float, turn: float) -> None:
    pricing = Pricing(group(max_swap_share=share), cost)
    assert pricing.turn_s(0.25) == pytest.approx(turn)
    # A cycle of one model: its swap, then its turn; the swap is `share` of it.
    assert cost / (cost + pricing.turn_s(0.25)) == pytest.approx(share)


def test_before_a_swap_is_measured_a_swap_costs_a_load() -> None:
    pricing = Pricing(group())
    assert pricing.swap_s(2.0) == 2.0
    assert pricing.turn_s(2.0) == pytest.approx(8.0)
    assert pricing.turn_s(None) == pytest.approx(4 * room.UNMEASURED_SWAP_S)


def test_min_turn_loads_is_a_floor_under_the_priced_turn() -> None:
    limits = GroupConfig("gpu", max_loaded=1, min_turn_loads=10.0)
    assert Pricing(limits, 1.0).turn_s(2.0) == pytest.approx(20.0)
    assert Pricing(limits, 1.0).turn_s(0.1) == pytest.approx(4.0)


def test_a_busy_model_goes_when_its_turn_is_over_or_a_request_waited_max_wait_s() -> None:
    victim = member("a", loaded_at=100.0)  # its turn: 4 s, until 104
    priced = Pricing(group(), 1.0)
    assert room.turn_over(priced, 101.0, victim) == pytest.approx(104.0)
    assert room.turn_over(priced, 110.0, victim) == pytest.approx(104.0)  # over: at once
    capped = Pricing(group(max_wait_s=2.0), 1.0)
    assert room.turn_over(capped, 101.0, victim) == pytest.approx(103.0)
    assert room.turn_over(capped, 90.0, victim) == pytest.approx(92.0)


def test_a_model_with_no_work_goes_at_once_whatever_its_turn() -> None:
    waiting = member("b", loaded_at=None)
    waiting.slot.in_flight = 1  # its request, as far as the rule reads it
    idle = member("a", loaded_at=100.0, busy=False)
    at = room.not_yet(Pricing(group(), 1.0), waiting.slot, idle, 100.1)
    assert at == pytest.approx(100.0 + room.IDLE_GRACE_S)
    assert room.not_yet(Pricing(group(), 1.0), waiting.slot, idle, 100.3) is None


def test_the_wait_bound_is_the_others_cycles_and_the_queue_bound_their_load_timeouts() -> None:
    three = [member(name, load_s=0.25) for name in "abc"]
    pricing = Pricing(group(), 1.0)
    assert room.wait_bound_s(pricing, three) == pytest.approx(2 * (1.0 + 4.0))
    assert room.queue_bound_s(pricing, three) == pytest.approx(2 * (60.0 + 1.0 + 4.0))
    capped = Pricing(group(max_wait_s=1.0), 1.0)
    assert room.wait_bound_s(capped, three) == pytest.approx(2 * (1.0 + 1.0))
    fifo = Pricing(group(policy="fifo"), 1.0)
    assert room.wait_bound_s(fifo, three) == pytest.approx(2 * 1.0)


def test_a_swap_is_measured_and_its_share_of_the_time_kept() -> None:
    clock = SwapClock(started=0.0)
    assert clock.cost_s() is None and clock.share(10.0) == 0.0
    assert clock.swapped(10.0, 12.0) == pytest.approx(2.0)
    clock.swapped(20.0, 21.0)
    clock.swapped(30.0, 34.0)
    assert clock.cost_s() == pytest.approx(2.0)  # the median of the last ones
    for _ in range(5):
        clock.swapped(35.0, 35.5)
    assert (clock.count, clock.cost_s()) == (8, pytest.approx(0.5))
    assert clock.share(40.0) == pytest.approx(9.5 / 40.0)
