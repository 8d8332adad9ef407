"""Slots: where a request waits its turn for an upstream, and where the upstream's state lives.

A slot is one upstream (a llama-server, a vLLM, a remote provider) with a capacity. Handlers take a
*lease* on it for as long as they use the upstream -- for a stream, until the client has drained
it -- so that the upstream never sees more than ``max_concurrent`` requests and everyone else waits
in a bounded queue instead of piling onto a box that serves one sequence at a time. The queue
serves its clients in turn (``ClientQueue``: round robin between clients, arrival order within
one), so a client that queued a burst does not hold back another's one request; with a single
client (no keys, no ``user`` in the bodies) it is strictly FIFO.

The state changes only in ``Slot.handle(event)``, by the table in machine.py: the lifecycle
manager tells the lifecycle's events, admission here tells ``leased`` (the first lease) and
``released`` (the last one). This module is pure asyncio: no sockets, no aiohttp, so admission can
be tested to the last race.

Semantics worth knowing:

* READY means in_flight == 0 and SERVING means in_flight > 0 (machine.UP).
* Leases are granted in READY, SERVING and ERROR. ERROR is still tried because the probe may be
  stale; a lease granted in ERROR leaves the state alone, and releasing the last one leaves it
  in ERROR. Not so after a failed start (``load_refused`` set in ERROR): no process of hal0d's
  listens there, and whatever else does must not answer for the slot. Releasing the last
  lease in STARTING, STOPPING or OFFLINE leaves those alone too.
* In STARTING, STOPPED and STOPPING, callers wait in the same queue and go, in their turns, once
  the slot is READY (or ERROR). A waiter that finds the slot STOPPED asks for a load (``demand``,
  set by the manager on an on-demand slot); while such a slot loads, a wait is bounded by
  ``load_timeout_s`` when that is longer than ``queue_timeout_s``, plus ``turn_wait_s`` (set by the
  manager in a group whose loads wait for a model's turn). A waiter still waiting when its bound
  runs out gets ``SlotLoading`` (503) if the slot is still loading, else ``QueueFull`` (429). A
  full queue answers the same way: ``SlotLoading`` while loading -- the honest reason -- else
  ``QueueFull``. A failed load fails every waiter at once with ``SlotLoadFailed``
  (``refuse_loads``) and refuses new requests the same way until its backoff has passed.
* STOPPED holds nothing in flight; STOPPING admits nothing new and drains what is in flight
  (``drained()``), so an unload never cuts a request.
* OFFLINE means nobody is bringing the slot up (not yet started, or shut down): ``lease()`` fails
  at once with ``SlotLoading``, and going offline fails every queued waiter the same way.
* ``reason`` says why the slot is in its state (the error text, the restart cause); it is None
  in READY and SERVING.
* Admission never polls: each waiter is a future, resolved exactly once -- by a grant (the
  capacity unit is counted at grant time), by its timeout timer, or by the slot going offline.
  A waiter cancelled while queued (its client left) removes itself; one cancelled in the same
  instant it was granted hands the unit on by releasing it, so capacity never leaks.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Protocol

import structlog

from hal0d.errors import Hal0Error, QueueFull, SlotLoadFailed, SlotLoading
from hal0d.lifecycle.machine import Event, Rule, SlotState, step

# Retry-After hints: a queue usually moves within a couple of seconds, a model load takes longer.
QUEUE_RETRY_AFTER_S: Final = 2.0
LOADING_RETRY_AFTER_S: Final = 5.0

log = structlog.get_logger(__name__)


_GRANTABLE: Final = frozenset({SlotState.READY, SlotState.SERVING, SlotState.ERROR})
# The states in which a request waits for a model to be (re)loaded rather than for capacity.
LOADING: Final = frozenset({SlotState.STOPPED, SlotState.STARTING, SlotState.STOPPING})
# The states in which a failed start or load refuses requests until its backoff has passed.
_REFUSING: Final = frozenset({SlotState.STOPPED, SlotState.ERROR})


class SlotLimits(Protocol):
    """The part of a slot's config a Slot reads (config.SlotConfig satisfies it): the limits
    admission enforces, and the upstream and models the admin view shows."""

    @property
    def name(self) -> str: ...
    @property
    def max_concurrent(self) -> int: ...
    @property
    def max_queue(self) -> int: ...
    @property
    def queue_timeout_s(self) -> float: ...
    @property
    def load_timeout_s(self) -> float: ...
    @property
    def upstream(self) -> str: ...
    @property
    def models(self) -> tuple[str, ...]: ...


StateListener = Callable[["Slot", SlotState, SlotState, "str | None"], None]


@dataclass(frozen=True, slots=True)
class Lease:
    slot: Slot
    queue_ms: float
    load_ms: float = 0.0  # the part of queue_ms spent waiting for the slot's model to load
    turn_ms: float = 0.0  # of load_ms, the wait for the model's turn in its group (a swap's)


ANONYMOUS: Final = ""  # the client of every request that names none


@dataclass(eq=False, slots=True)
class _Waiter:
    fut: asyncio.Future[None]
    client: str
    since: float  # monotonic


class ClientQueue:
    """The waiters of one slot, by client: the next to go is the head of the client whose turn it
    is (round robin; a client with nothing queued has no turn), so a burst of one client and
    the single request of another alternate. Within one client, arrival order.

    Bounded by its slot (``max_queue``); every operation is O(clients) or O(one client's queue).
    """

    __slots__ = ("_by_client", "_count", "_index", "_turns")

    def __init__(self) -> None:
        self._by_client: dict[str, collections.deque[_Waiter]] = {}
        self._turns: collections.deque[str] = collections.deque()  # clients with waiters
        self._index: dict[asyncio.Future[None], _Waiter] = {}
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def append(self, fut: asyncio.Future[None], client: str) -> None:
        waiter = _Waiter(fut, client, time.monotonic())
        queue = self._by_client.get(client)
        if queue is None:
            queue = self._by_client[client] = collections.deque()
            self._turns.append(client)
        queue.append(waiter)
        self._index[fut] = waiter
        self._count += 1

    def popleft(self) -> asyncio.Future[None]:
        """The next waiter in turn (IndexError when empty); its client goes to the back."""
        client = self._turns.popleft()
        queue = self._by_client[client]
        waiter = queue.popleft()
        if queue:
            self._turns.append(client)
        else:
            del self._by_client[client]
        del self._index[waiter.fut]
        self._count -= 1
        return waiter.fut

    def remove(self, fut: asyncio.Future[None]) -> None:
        """ValueError when `fut` is not queued."""
        waiter = self._index.pop(fut, None)
        if waiter is None:
            raise ValueError("not queued")
        queue = self._by_client[waiter.client]
        queue.remove(waiter)
        self._count -= 1
        if not queue:
            del self._by_client[waiter.client]
            self._turns.remove(waiter.client)

    def oldest_since(self) -> float | None:
        """When the longest-waiting request came (monotonic), or None with nobody waiting."""
        return min((queue[0].since for queue in self._by_client.values()), default=None)


class Slot:
    def __init__(
        self,
        config: SlotLimits,
        *,
        on_change: StateListener | None = None,
        state: SlotState = SlotState.OFFLINE,
    ) -> None:
        self.config = config
        self.name = config.name
        self.state = state
        self.reason: str | None = None
        self.in_flight = 0
        self.on_change = on_change
        # Further listeners (the lifecycle manager, the event feed), told after on_change.
        self.watchers: list[StateListener] = []
        # Set by the lifecycle manager on an on-demand slot: told when a request finds it
        # stopped, so that it loads the slot.
        self.demand: Callable[[Slot], None] | None = None
        # After a failed load: (monotonic time before which no new load is tried, its cause).
        self.load_refused: tuple[float, str] | None = None
        # Told when in_flight or queued changed (the event feed coalesces these).
        self.on_counts: Callable[[Slot], None] | None = None
        # Further listeners of the counts (the lifecycle manager: a swap waits on them).
        self.count_watchers: list[Callable[[Slot], None]] = []
        # Set by the lifecycle manager in a group whose loads wait for their turn: the longest
        # that wait may be, added to a waiter's bound while the slot is not up.
        self.turn_wait_s = 0.0
        # While the slot's load waits for its turn in its group: since when (monotonic); after,
        # the last such wait (began, ended), which the requests that waited through it count.
        self.turn_began: float | None = None
        self.last_turn: tuple[float, float] | None = None
        self._drained: list[asyncio.Future[None]] = []
        # Only pending futures; a future leaves the queue before it is resolved, except a
        # cancelled one, which lingers until its task runs or the pump skips it.
        self._waiters = ClientQueue()

    def __repr__(self) -> str:
        return f"<Slot {self.name} {self.state} in_flight={self.in_flight} queued={self.queued}>"

    @property
    def queued(self) -> int:
        return len(self._waiters)

    def oldest_waiting_since(self) -> float | None:
        """When the request waiting longest came (monotonic); None with nobody queued."""
        return self._waiters.oldest_since()

    def turn_wait(self, waiting: bool) -> None:
        """The manager says the slot's load began (True) or ended (False) waiting for its
        turn in its group."""
        now = time.monotonic()
        if waiting and self.turn_began is None:
            self.turn_began = now
        elif not waiting and self.turn_began is not None:
            self.last_turn = (self.turn_began, now)
            self.turn_began = None

    def turn_ms(self, since: float, now: float) -> float:
        """How much of [since, now] the slot's load spent waiting for its turn."""
        began, ended = (self.turn_began, now) if self.turn_began is not None else (
            self.last_turn or (0.0, 0.0))
        return max(0.0, min(ended, now) - max(began, since)) * 1000.0

    # -- the state machine -------------------------------------------------------------------

    def handle(self, event: Event, reason: str | None = None) -> Rule:
        """The one place the state changes: `event` by the table (machine.py), which refuses
        a pair it does not list with IllegalEvent. A step into the current state only updates
        the reason (when one is given) and tells nobody. Returns the rule, whose actions are
        the caller's to carry out."""
        old = self.state
        new, rule = step(self.name, old, event, self.in_flight)
        if new is old:
            if reason is not None:
                self.reason = reason
            return rule
        self.state = new
        self.reason = reason
        self._notify(old, new, reason)
        if new is SlotState.OFFLINE:
            self._fail_waiters()
        elif new in _GRANTABLE and old not in _GRANTABLE:
            self._pump()
        return rule

    def _notify(self, old: SlotState, new: SlotState, reason: str | None) -> None:
        listeners = [self.on_change, *self.watchers] if self.on_change else self.watchers
        for listener in listeners:
            # A broken hook must not wedge admission halfway through a grant or a release.
            try:
                listener(self, old, new, reason)
            except Exception:
                log.exception("slot.listener_failed", slot=self.name, old=old, new=new)

    # -- what the lifecycle manager asks of admission ---------------------------------------

    def refuse_loads(self, cause: str, retry_after_s: float) -> None:
        """A load failed: every waiter gets SlotLoadFailed with `cause` at once, and so do new
        requests until the backoff has passed."""
        self.load_refused = (time.monotonic() + retry_after_s, cause)
        self.fail_waiters(SlotLoadFailed(self._load_failure(cause), retry_after=retry_after_s))

    def _load_failure(self, cause: str) -> str:
        return f"slot {self.name!r} could not load its model: {cause}"

    def fail_waiters(self, error: Hal0Error) -> None:
        """Every queued request gets `error` (a forced unload)."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
        self._counts()

    async def drained(self) -> None:
        """Returns once nothing is in flight (an unload waits for this before it stops the
        process: in-flight requests are never cut to make room)."""
        if self.in_flight == 0:
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._drained.append(fut)
        await fut

    # -- admission ---------------------------------------------------------------------------

    def lease(self, client: str = ANONYMOUS) -> _LeaseContext:
        """``async with slot.lease() as lease:`` holds one unit of capacity for the block;
        `client` is whose turn the request waits for in the queue."""
        return _LeaseContext(self, client)

    def _can_grant(self) -> bool:
        return (self.state in _GRANTABLE and self.in_flight < self.config.max_concurrent
                and not (self.state is SlotState.ERROR and self.load_refused is not None))

    def _counts(self) -> None:
        if self.on_counts is not None:
            self.on_counts(self)
        for watcher in self.count_watchers:
            watcher(self)

    def _take(self) -> None:
        self.in_flight += 1
        if self.in_flight == 1:
            self.handle(Event.LEASED)
        self._counts()

    def _release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._drained:
            for fut in self._drained:
                if not fut.done():
                    fut.set_result(None)
            self._drained.clear()
        # Hand the unit on before looking at the state, so a busy slot does not flap
        # serving -> ready -> serving between two requests.
        self._pump()
        if self.in_flight == 0:
            self.handle(Event.RELEASED)
        self._counts()

    def reconfigure(self, config: SlotLimits) -> None:
        """New limits from a reload; a larger max_concurrent admits waiters at once."""
        self.config = config
        self._pump()

    def _pump(self) -> None:
        while self._waiters and self._can_grant():
            fut = self._waiters.popleft()
            if fut.done():
                continue
            fut.set_result(None)
            self._take()

    def _refusal(self, what: str) -> QueueFull | SlotLoading:
        if self.state in LOADING:
            return SlotLoading(
                f"slot {self.name!r} is still loading ({self.state}): {what}",
                retry_after=LOADING_RETRY_AFTER_S,
            )
        return QueueFull(f"slot {self.name!r}: {what}", retry_after=QUEUE_RETRY_AFTER_S)

    def _offline(self) -> SlotLoading:
        return SlotLoading(f"slot {self.name!r} is offline", retry_after=LOADING_RETRY_AFTER_S)

    async def _acquire(self, client: str = ANONYMOUS) -> None:
        if self.state is SlotState.OFFLINE:
            raise self._offline()
        # Only with nobody queued: a newcomer never overtakes a waiter, even at the instant
        # a unit frees up.
        if not self._waiters and self._can_grant():
            self._take()
            return
        if self.state in _REFUSING and self.load_refused is not None:
            not_before, cause = self.load_refused
            if time.monotonic() < not_before:
                raise SlotLoadFailed(
                    self._load_failure(cause), retry_after=not_before - time.monotonic()
                )
        if len(self._waiters) >= self.config.max_queue:
            raise self._refusal(f"queue is full ({self.config.max_queue} waiting)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut, client)
        self._counts()
        # Normally a no-op (units are handed over on release); it only matters if cancelled
        # futures still linger at the head while a unit is free, which must not strand us.
        self._pump()
        timeout_s = self.config.queue_timeout_s
        if self.state in LOADING and self.demand is not None:
            # An on-demand slot: the request waits for the load it asks for (or joins).
            timeout_s = max(timeout_s, self.config.load_timeout_s) + self.turn_wait_s
            if self.state is SlotState.STOPPED:
                self.demand(self)
        timer = loop.call_later(timeout_s, self._expire, fut, timeout_s)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted and cancelled in the same instant: the unit is ours, pass it on.
                self._release()
            else:
                self._discard(fut)
            raise
        finally:
            timer.cancel()

    def _expire(self, fut: asyncio.Future[None], timeout_s: float) -> None:
        if fut.done():
            return
        self._discard(fut)
        fut.set_exception(self._refusal(f"no capacity within {timeout_s:g}s"))

    def _discard(self, fut: asyncio.Future[None]) -> None:
        with contextlib.suppress(ValueError):
            self._waiters.remove(fut)
            self._counts()

    def _fail_waiters(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(self._offline())
        self._counts()

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "state": str(self.state),
            "reason": self.reason,
            "upstream": self.config.upstream,
            "models": list(self.config.models),
            "in_flight": self.in_flight,
            "queued": self.queued,
            "max_concurrent": self.config.max_concurrent,
        }


class _LeaseContext:
    __slots__ = ("_client", "_held", "_slot", "_started")

    def __init__(self, slot: Slot, client: str = ANONYMOUS) -> None:
        self._slot = slot
        self._client = client
        self._started = time.monotonic()
        self._held = False

    async def __aenter__(self) -> Lease:
        slot = self._slot
        loading = slot.state in LOADING
        await slot._acquire(self._client)
        self._held = True
        now = time.monotonic()
        waited_ms = (now - self._started) * 1000.0
        if not loading:
            return Lease(slot, waited_ms)
        return Lease(slot, waited_ms, waited_ms, min(waited_ms, slot.turn_ms(self._started, now)))

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._held:
            self._held = False
            self._slot._release()


class SlotTable:
    """Every configured slot by name, in config order."""

    def __init__(
        self, configs: Iterable[SlotLimits], *, on_change: StateListener | None = None
    ) -> None:
        self._slots: dict[str, Slot] = {}
        for config in configs:
            if config.name in self._slots:
                raise ValueError(f"duplicate slot name {config.name!r}")
            self._slots[config.name] = Slot(config, on_change=on_change)

    def get(self, name: str) -> Slot | None:
        return self._slots.get(name)

    def add(self, slot: Slot) -> None:
        """A slot a reload added."""
        if slot.name in self._slots:
            raise ValueError(f"duplicate slot name {slot.name!r}")
        self._slots[slot.name] = slot

    def remove(self, name: str) -> Slot:
        """A slot a reload removed; the caller takes it offline."""
        return self._slots.pop(name)

    def lease(self, name: str, client: str = ANONYMOUS) -> _LeaseContext:
        """A lease on the named slot; SlotLoading (503) when a reload has just removed it."""
        slot = self._slots.get(name)
        if slot is None:
            raise SlotLoading(
                f"slot {name!r} was removed by a configuration reload", retry_after=1.0
            )
        return slot.lease(client)

    def __getitem__(self, name: str) -> Slot:
        return self._slots[name]

    def __contains__(self, name: object) -> bool:
        return name in self._slots

    def __iter__(self) -> Iterator[Slot]:
        return iter(self._slots.values())

    def __len__(self) -> int:
        return len(self._slots)

    def names(self) -> list[str]:
        return list(self._slots)

    def snapshot(self) -> list[dict[str, Any]]:
        return [slot.snapshot() for slot in self._slots.values()]
