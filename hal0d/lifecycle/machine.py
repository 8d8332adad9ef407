"""The slot lifecycle's rules: (state, event) -> (new state, actions), one explicit table.

Pure: no asyncio, no aiohttp, no clock. Every slot, `always` or `on_demand`, runs through the same
table; the lifecycle manager (manager.py) is the one that tells a slot's lifecycle events and
carries out the actions a step returns, and admission (slots.py) tells the two lease events. A
pair that is not in the table is refused with ``IllegalEvent`` and changes nothing, as h11
refuses an event in the wrong state: a late answer from a process that was already stopped can
never mark its slot ready.

The states::

    offline   nobody brings the slot up (before its start, after a shutdown or its removal)
    stopped   no process: an on-demand slot at rest, or after an unload or a failed load
    starting  its process was launched and is probed until it answers
    ready     it answers, nothing in flight
    serving   it answers, requests in flight (held until the last stream is drained)
    error     its probe failed, or its process exited or could not be started
    stopping  an unload: nothing new admitted, what is in flight drains, then the process stops

``UP`` as a target is ``ready`` with nothing in flight and ``serving`` with leases in flight: a
slot that answers again under load is serving, as it always was. A step into the state the slot
is already in is no transition: the reason may change, nobody is told.

The events and who tells them:

    rest          the manager: an on-demand slot at start; one whose process exited with nothing
                  waiting for it
    start         the manager: bring the process up (an `always` slot at start and after its
                  backoff; an on-demand one a request or the API wants)
    launch        the start's own task: the group's turn and room are had, the process launches
    answered      the start's own task: the new process answered its probe
    start_failed  ... an `always` slot's process could not be brought up, or the restart that
                  leases in flight waited for (their connect refused as the process died):
                  retried after backoff
    load_failed   ... an on-demand slot's load failed: its waiters fail, loads are refused for
                  the backoff
    no_room       ... its group can never make room for it (nothing it could unload): its
                  waiters fail with the reason, and nothing is refused after them (no backoff:
                  the model did not fail, and room may come with the next request)
    probe_ok      the periodic probe (and a slot without a command's first probe)
    probe_failed  the same, failed
    exited        the manager's watch: a process that was up exited on its own (while it is
                  wanted, the slot grants nothing until the restart answers: Slot.hold)
    unload        the API, the idle timer, an eviction, a reload
    replace       a reload that changed an `always` slot's process: it is `starting` from then
                  on (new requests wait for the new process) while the old one drains and stops
    gone          the unload's (or the replace's) own task: the process is gone, its memory free
    leased        admission: the first lease is granted
    released      admission: the last lease is released
    shutdown      hal0d stops, or a reload removes the slot
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from hal0d.lifecycle.vocabulary import EVICTABLE, SlotState


class Event(enum.StrEnum):
    REST = "rest"
    START = "start"
    LAUNCH = "launch"
    ANSWERED = "answered"
    START_FAILED = "start_failed"
    LOAD_FAILED = "load_failed"
    NO_ROOM = "no_room"
    PROBE_OK = "probe_ok"
    PROBE_FAILED = "probe_failed"
    EXITED = "exited"
    UNLOAD = "unload"
    REPLACE = "replace"
    GONE = "gone"
    LEASED = "leased"
    RELEASED = "released"
    SHUTDOWN = "shutdown"


class Action(enum.StrEnum):
    """What the manager does after a step (admission's own consequences, granting waiters when a
    slot becomes grantable and failing them when it goes offline, follow from the state)."""

    BRING_UP = "bring_up"  # a task: the group's turn, room made, launch, probe until it answers
    LOADED = "loaded"  # the start succeeded: its backoff reset, loads no longer refused
    RETRY_LATER = "retry_later"  # start again once the backoff has passed
    REFUSE_LOADS = "refuse_loads"  # fail every waiter with the cause; refuse loads for the backoff
    FAIL_WAITERS = "fail_waiters"  # fail every waiter with the cause; the next request may load
    RECOVER = "recover"  # the process exited: start again when wanted, else rest
    STOP_PROCESS = "stop_process"  # a task: cancel a start, drain, stop the process, then `gone`
    UNLOADED = "unloaded"  # an unload ended: told to observers; loaded again if still wanted


class Up:
    """The target `ready` or `serving`, by what is in flight."""

    def __repr__(self) -> str:
        return "UP"


UP: Final = Up()
Target = SlotState | Up


@dataclass(frozen=True, slots=True)
class Rule:
    target: Target
    actions: tuple[Action, ...]
    why: str


class IllegalEvent(RuntimeError):
    def __init__(self, slot: str, state: SlotState, event: Event, why: str) -> None:
        super().__init__(f"slot {slot!r}: {event} in {state}: {why}")
        self.slot = slot
        self.state = state
        self.event = event


_S, _E, _A = SlotState, Event, Action


def _rules() -> dict[tuple[SlotState, Event], Rule]:  # long: one table, read whole
    rules: dict[tuple[SlotState, Event], Rule] = {
        (_S.OFFLINE, _E.REST): Rule(_S.STOPPED, (), "on-demand slot at start"),
        (_S.OFFLINE, _E.START): Rule(_S.OFFLINE, (_A.BRING_UP,), "always slot at start"),
        (_S.STOPPED, _E.START): Rule(_S.STOPPED, (_A.BRING_UP,), "load wanted"),
        (_S.ERROR, _E.START): Rule(_S.ERROR, (_A.BRING_UP,), "restart after the backoff"),
        (_S.STARTING, _E.START): Rule(_S.STARTING, (), "already starting: the request joins"),
        (_S.READY, _E.START): Rule(_S.READY, (), "already up"),
        (_S.SERVING, _E.START): Rule(_S.SERVING, (), "already up"),
        (_S.OFFLINE, _E.LAUNCH): Rule(_S.STARTING, (), "process launching"),
        (_S.STOPPED, _E.LAUNCH): Rule(_S.STARTING, (), "process launching"),
        (_S.ERROR, _E.LAUNCH): Rule(_S.STARTING, (), "process relaunching"),
        (_S.STARTING, _E.ANSWERED): Rule(UP, (_A.LOADED,), "process answered its probe"),
        (_S.STARTING, _E.START_FAILED): Rule(_S.ERROR, (_A.RETRY_LATER,),
                                             "start failed: retried after the backoff"),
        (_S.STARTING, _E.LOAD_FAILED): Rule(_S.STOPPED, (_A.REFUSE_LOADS,), "load failed"),
        (_S.STOPPED, _E.LOAD_FAILED): Rule(_S.STOPPED, (_A.REFUSE_LOADS,),
                                           "no room in the group: nothing was launched"),
        (_S.ERROR, _E.LOAD_FAILED): Rule(_S.STOPPED, (_A.REFUSE_LOADS,),
                                         "no room for the restart: nothing was launched"),
        (_S.STOPPED, _E.NO_ROOM): Rule(_S.STOPPED, (_A.FAIL_WAITERS,),
                                       "no room in the group: nothing was launched"),
        (_S.ERROR, _E.NO_ROOM): Rule(_S.STOPPED, (_A.FAIL_WAITERS,),
                                     "no room for the restart: nothing was launched"),
        (_S.ERROR, _E.START_FAILED): Rule(_S.ERROR, (_A.RETRY_LATER,),
                                          "no room for the restart that leases in flight wait "
                                          "for: retried after the backoff"),
        (_S.OFFLINE, _E.PROBE_OK): Rule(UP, (), "first probe ok (no command)"),
        (_S.OFFLINE, _E.PROBE_FAILED): Rule(_S.ERROR, (), "first probe failed (no command)"),
        (_S.READY, _E.PROBE_OK): Rule(_S.READY, (), "still answering"),
        (_S.SERVING, _E.PROBE_OK): Rule(_S.SERVING, (), "still answering"),
        (_S.ERROR, _E.PROBE_OK): Rule(UP, (), "answering again"),
        (_S.READY, _E.PROBE_FAILED): Rule(_S.ERROR, (), "probe failed"),
        (_S.SERVING, _E.PROBE_FAILED): Rule(_S.ERROR, (), "probe failed under load"),
        (_S.ERROR, _E.PROBE_FAILED): Rule(_S.ERROR, (), "still failing"),
        (_S.ERROR, _E.REST): Rule(_S.STOPPED, (), "exited, and nothing waits for it"),
        (_S.STARTING, _E.UNLOAD): Rule(_S.STOPPING, (_A.STOP_PROCESS,), "unload during a load"),
        (_S.STOPPED, _E.UNLOAD): Rule(_S.STOPPED, (), "nothing to unload"),
        (_S.STOPPING, _E.UNLOAD): Rule(_S.STOPPING, (), "already unloading"),
        (_S.STOPPING, _E.GONE): Rule(_S.STOPPED, (_A.UNLOADED,), "process gone"),
        # A replace: the old process drains and stops with the slot `starting`; once it is gone
        # the new config is taken on and its process brought up, which launches in `starting`.
        (_S.STARTING, _E.REPLACE): Rule(_S.STARTING, (_A.STOP_PROCESS,),
                                        "replaced during its start: that start is cancelled"),
        (_S.STARTING, _E.GONE): Rule(_S.STARTING, (_A.UNLOADED, _A.BRING_UP),
                                     "the replaced process gone: the new one is brought up"),
        (_S.STARTING, _E.LAUNCH): Rule(_S.STARTING, (), "the replacing process launching"),
        (_S.READY, _E.LEASED): Rule(_S.SERVING, (), "first lease granted"),
        (_S.SERVING, _E.LEASED): Rule(_S.SERVING, (), "the last unit handed on as released"),
        (_S.ERROR, _E.LEASED): Rule(_S.ERROR, (), "tried in error: the probe may be stale"),
        (_S.SERVING, _E.RELEASED): Rule(_S.READY, (), "last lease released"),
    }
    for state in EVICTABLE:
        rules[(state, _E.EXITED)] = Rule(_S.ERROR, (_A.RECOVER,), "process exited")
        rules[(state, _E.UNLOAD)] = Rule(_S.STOPPING, (_A.STOP_PROCESS,), "unload")
        rules[(state, _E.REPLACE)] = Rule(_S.STARTING, (_A.STOP_PROCESS,),
                                          "replaced by a reload: the old process drains first")
    # The last lease of a request from before: the state is not admission's to change there.
    for state in (_S.OFFLINE, _S.STARTING, _S.ERROR, _S.STOPPING):
        rules[(state, _E.RELEASED)] = Rule(state, (), "last lease released; state kept")
    for state in SlotState:
        rules[(state, _E.SHUTDOWN)] = Rule(_S.OFFLINE, (), "shutdown")
    return rules


RULES: Final[Mapping[tuple[SlotState, Event], Rule]] = _rules()


def step(slot: str, state: SlotState, event: Event, in_flight: int) -> tuple[SlotState, Rule]:
    """The state `event` leads to from `state` and the rule that says so; IllegalEvent when the
    table has no such pair, or the target contradicts what is in flight."""
    rule = RULES.get((state, event))
    if rule is None:
        raise IllegalEvent(slot, state, event, "not in the table")
    target = rule.target
    if isinstance(target, Up):
        return (_S.SERVING if in_flight else _S.READY), rule
    if target is _S.STOPPED and in_flight:
        raise IllegalEvent(slot, state, event, f"stopped with {in_flight} in flight")
    if target is _S.READY and in_flight:
        raise IllegalEvent(slot, state, event, f"ready with {in_flight} in flight")
    return target, rule


def allows(state: SlotState, event: Event) -> bool:
    """Whether the table has the pair (a probe's answer that arrives late checks first)."""
    return (state, event) in RULES
