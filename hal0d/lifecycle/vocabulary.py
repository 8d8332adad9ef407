"""The lifecycle's words, in one place: a slot's states and the sets of them that mean something
(up, grantable, loaded, evictable), a load's phases, why a slot unloads, a swap's steps, and how
a start ends. Every module that asks "is this slot up?" asks it with these names, so a new state
is added here once and not in six modules.

Pure: no asyncio, no aiohttp.
"""

from __future__ import annotations

import enum
from typing import Final


class SlotState(enum.StrEnum):
    """A slot's state; machine.py's table says how one leads to another."""

    OFFLINE = "offline"
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    SERVING = "serving"
    ERROR = "error"
    STOPPING = "stopping"


_S = SlotState
# It answers: ready with nothing in flight, serving with requests in flight.
UP: Final = frozenset({_S.READY, _S.SERVING})
# Leases are granted there (in error too: the probe may be stale).
GRANTABLE: Final = frozenset({_S.READY, _S.SERVING, _S.ERROR})
# A lease waiting for its process's fate learns there that it will not be up again.
DOWN: Final = frozenset({_S.STOPPED, _S.STOPPING, _S.OFFLINE})
# A request waits there for a model to be (re)loaded rather than for capacity.
LOADING: Final = frozenset({_S.STOPPED, _S.STARTING, _S.STOPPING})
# A failed start or load refuses requests there until its backoff has passed.
REFUSING: Final = frozenset({_S.STOPPED, _S.ERROR})
# Its process is alive (or being started): it occupies its device.
LOADED: Final = frozenset({_S.STARTING, _S.READY, _S.SERVING, _S.ERROR, _S.STOPPING})
# A victim may be unloaded from these to make room.
EVICTABLE: Final = frozenset({_S.READY, _S.SERVING, _S.ERROR})


class LoadPhase(enum.StrEnum):
    """Where a load is, as the event feed and the metrics tell it."""

    WAITING_FOR_ROOM = "waiting_for_room"
    STARTING = "starting"
    PROBING = "probing"
    READY = "ready"
    FAILED = "failed"
    WITHDRAWN = "withdrawn"  # no request waited for it any more: nothing was loaded


class UnloadReason(enum.StrEnum):
    IDLE = "idle"
    KEEP_ALIVE = "keep_alive"  # the idle wait a client's keep_alive set (0: at once)
    EVICTED = "evicted"
    API = "api"
    RELOAD = "reload"
    SHUTDOWN = "shutdown"


class SwapPhase(enum.StrEnum):
    PLANNED = "planned"  # a load waits for room that a busy model holds (batch: until its turn)
    STARTED = "started"  # the victim is being unloaded (it drains first)
    DONE = "done"  # the victim is gone: the waiting model loads


class Started(enum.StrEnum):
    """How a start ended."""

    ANSWERED = "answered"  # its process answers: it is up
    FAILED = "failed"  # its cause and backoff recorded (Runner.failed)
    NO_ROOM = "no_room"  # its group cannot make room for it: nothing launched, no backoff
    WITHDRAWN = "withdrawn"  # no request waited for it any more: nothing was launched
