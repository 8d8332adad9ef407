"""A slot's state machine: the lifecycle table both ways (every listed pair steps to its target
with its actions, every other pair is refused and changes nothing), the playbooks of an always and
an on-demand slot's lives, and the races it refuses. Leases and the queue are tested in
test_slots.py."""

from __future__ import annotations

import pytest

from hal0d.lifecycle.machine import RULES, UP, Action, Event, IllegalEvent, allows
from hal0d.lifecycle.manager import LifecycleManager
from hal0d.lifecycle.slots import Slot, SlotState
from tests.harness.slots import Cfg, E, S, Seen, make_slot

# -- the lifecycle table, both ways (as h11 tests its own) ------------------------------------


def consistent_in_flight(state: SlotState, event: Event) -> int:
    """What is in flight when `event` arrives in `state` in a running hal0d: admission tells
    `leased` once the first lease is counted and `released` once the last one is gone; a
    serving slot has leases; an `exited`/`probe_*` in serving too."""
    if event is E.LEASED:
        return 1
    if event is E.RELEASED:
        return 0
    return 1 if state is S.SERVING else 0


@pytest.mark.parametrize(("state", "event"), sorted(RULES))
def test_every_listed_pair_steps_to_its_target_and_returns_its_actions(
    state: SlotState, event: Event
) -> None:
    slot, changes = make_slot(state)
    slot.in_flight = consistent_in_flight(state, event)
    rule = RULES[(state, event)]
    returned = slot.handle(event, "why")
    target = rule.target
    if target is UP:
        target = S.SERVING if slot.in_flight else S.READY
    assert slot.state is target
    assert returned is rule
    if target is state:
        assert changes == []  # a step into the same state tells nobody
    else:
        assert changes == [("llm", state, target, "why")]
    assert slot.reason == "why"


def test_every_pair_outside_the_table_is_refused_and_changes_nothing() -> None:
    refused = 0
    for state in S:
        for event in E:
            if (state, event) in RULES:
                continue
            slot, changes = make_slot(state)
            slot.reason = "before"
            with pytest.raises(IllegalEvent) as info:
                slot.handle(event, "after")
            assert "'llm'" in str(info.value) and str(event) in str(info.value)
            assert (slot.state, slot.reason, changes) == (state, "before", [])
            assert not allows(state, event)
            refused += 1
    assert refused > 0 and refused + len(RULES) == len(S) * len(E)


@pytest.mark.parametrize(
    ("state", "event", "in_flight"),
    [
        (S.STARTING, E.LOAD_FAILED, 1),  # stopped with a lease in flight
        (S.STOPPING, E.GONE, 2),  # the process gone before the drain
        (S.ERROR, E.REST, 1),
        (S.SERVING, E.RELEASED, 1),  # ready with a lease in flight
    ],
)
def test_a_target_that_contradicts_what_is_in_flight_is_refused(
    state: SlotState, event: Event, in_flight: int
) -> None:
    slot, changes = make_slot(state)
    slot.in_flight = in_flight
    with pytest.raises(IllegalEvent):
        slot.handle(event)
    assert (slot.state, changes) == (state, [])


def test_every_state_event_and_action_is_in_the_table_and_every_action_is_carried_out() -> None:
    assert {state for state, _ in RULES} == set(S)
    assert {event for _, event in RULES} == set(E)
    assert {action for rule in RULES.values() for action in rule.actions} == set(Action)
    # The teller carries out each action by the manager's method of its name.
    assert all(callable(getattr(LifecycleManager, f"_{action}", None)) for action in Action)
    reached = {rule.target for rule in RULES.values()}
    assert reached - {UP} | {S.READY, S.SERVING} == set(S)


def test_an_always_slot_and_an_on_demand_slot_run_through_the_same_table() -> None:
    """Playbooks: the events of a life, the states and actions they lead to."""
    always, _ = make_slot(S.OFFLINE)
    steps = [(E.START, S.OFFLINE, (Action.BRING_UP,)), (E.LAUNCH, S.STARTING, ()),
             (E.ANSWERED, S.READY, (Action.LOADED,)), (E.EXITED, S.ERROR, (Action.RECOVER,)),
             (E.START, S.ERROR, (Action.BRING_UP,)), (E.LAUNCH, S.STARTING, ()),
             (E.START_FAILED, S.ERROR, (Action.RETRY_LATER,)), (E.START, S.ERROR,
                                                                 (Action.BRING_UP,)),
             (E.LAUNCH, S.STARTING, ()), (E.ANSWERED, S.READY, (Action.LOADED,)),
             (E.SHUTDOWN, S.OFFLINE, ())]
    for event, state, actions in steps:
        assert always.handle(event).actions == actions, event
        assert always.state is state, event
    on_demand, _ = make_slot(S.OFFLINE)
    steps = [(E.REST, S.STOPPED, ()), (E.START, S.STOPPED, (Action.BRING_UP,)),
             (E.LAUNCH, S.STARTING, ()), (E.LOAD_FAILED, S.STOPPED, (Action.REFUSE_LOADS,)),
             (E.START, S.STOPPED, (Action.BRING_UP,)), (E.LAUNCH, S.STARTING, ()),
             (E.ANSWERED, S.READY, (Action.LOADED,)), (E.UNLOAD, S.STOPPING,
                                                       (Action.STOP_PROCESS,)),
             (E.GONE, S.STOPPED, (Action.UNLOADED,)), (E.START, S.STOPPED, (Action.BRING_UP,)),
             (E.LAUNCH, S.STARTING, ()), (E.ANSWERED, S.READY, (Action.LOADED,)),
             (E.EXITED, S.ERROR, (Action.RECOVER,)), (E.REST, S.STOPPED, ())]
    for event, state, actions in steps:
        assert on_demand.handle(event).actions == actions, event
        assert on_demand.state is state, event


def test_a_late_answer_after_an_unload_is_refused() -> None:
    """The race a forced unload during a load once lost: stopped -> ready is no step."""
    slot, _ = make_slot(S.STARTING)
    slot.handle(E.UNLOAD)
    slot.handle(E.GONE)
    with pytest.raises(IllegalEvent):
        slot.handle(E.ANSWERED)
    assert slot.state is S.STOPPED


def test_a_step_into_the_same_state_only_updates_the_reason() -> None:
    slot, changes = make_slot(S.OFFLINE)
    slot.handle(E.PROBE_FAILED, "probe: connection refused")
    slot.handle(E.PROBE_FAILED, "probe: timeout")
    assert slot.reason == "probe: timeout"
    slot.handle(E.PROBE_OK)
    slot.handle(E.PROBE_OK)
    assert [(old, new) for _, old, new, _ in changes] == [(S.OFFLINE, S.ERROR), (S.ERROR, S.READY)]


def test_answering_again_lands_in_serving_when_leases_are_in_flight() -> None:
    slot, _ = make_slot(S.ERROR)
    slot.in_flight = 2
    slot.handle(E.PROBE_OK)
    assert slot.state is S.SERVING
    assert slot.reason is None


def test_a_failing_listener_does_not_wedge_admission() -> None:
    slot = Slot(Cfg(), observer=Seen(fail=RuntimeError("metrics broke")),  # type: ignore[arg-type]
                state=S.STARTING)
    slot.handle(E.ANSWERED)
    assert slot.state is S.READY
