"""Slots: where a request waits its turn for an upstream, and where the upstream's state lives.

A slot is one upstream (a llama-server, a vLLM, a remote provider) with a capacity. Handlers take a
*lease* on it for as long as they use the upstream -- for a stream, until the client has drained
it -- so that the upstream never sees more than ``max_concurrent`` requests and everyone else waits
in a bounded queue instead of piling onto a box that serves one sequence at a time. The queue
(``ClientQueue``, turns.py) serves interactive work before batch work and keys by their share of
the tokens, then its clients in turn (round robin between clients, arrival order within one), so
a client that queued a burst does not hold back another's one request; with a single client (no
keys, no ``user`` in the bodies) it is strictly FIFO. A request whose connect is refused may
meet its process's death (fates.py).

The state changes only in ``Slot.handle(event)``, by the table in machine.py: the lifecycle
manager tells the lifecycle's events, admission here tells ``leased`` (the first lease) and
``released`` (the last one). This module is pure asyncio: no sockets, no aiohttp, so admission can
be tested to the last race.

Semantics worth knowing:

* READY means in_flight == 0 and SERVING means in_flight > 0 (machine.UP).
* Leases are granted in READY, SERVING and ERROR. ERROR is still tried because the probe may be
  stale; a lease granted in ERROR leaves the state alone, and releasing the last one leaves it
  in ERROR. Not so after a failed start or an exit (``load_refused`` set in ERROR, ``hold``):
  no process of hal0d's listens there until its restart answers, and whatever else does must
  not answer for the slot; requests wait in the queue for the restart meanwhile. Releasing the
  last lease in STARTING, STOPPING or OFFLINE leaves those alone too.
* A request that holds a lease and whose connect is refused may have been granted in the
  instant between its process's death and the lifecycle seeing the exit (the kernel closes a
  dead process's sockets before its parent learns of the exit): ``process_fate()`` has it wait
  for the restart, as a queued request waits, instead of failing. A lease granted in that
  instant does not connect at all once its process is gone (``process_gone()``): another
  program may listen on the port by then, and must not be sent the slot's request.
* In STARTING, STOPPED and STOPPING, callers wait in the same queue and go, in their turns, once
  the slot is READY (or ERROR). A waiter that finds the slot STOPPED asks for a load (``demand``,
  set by the manager on an on-demand slot); while such a slot loads, a wait is bounded by
  ``load_timeout_s`` when that is longer than ``queue_timeout_s``, plus ``turn_wait_s`` (set by the
  manager in a group whose loads wait for a model's turn). A waiter still waiting when its bound
  runs out gets ``SlotLoading`` (503) if the slot is still loading (or waits for its process to
  start again), else ``QueueFull`` (429). A
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
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Protocol

import structlog

from hal0d.errors import Hal0Error, QueueFull, SlotLoadFailed, SlotLoading, without_address
from hal0d.lifecycle.fates import LOADING_RETRY_AFTER_S, ProcessFates
from hal0d.lifecycle.machine import Event, Rule, step
from hal0d.lifecycle.turns import ANONYMOUS, ClientQueue, Rank
from hal0d.lifecycle.vocabulary import GRANTABLE, LOADING, REFUSING, SlotState
from hal0d.shares import DEFAULT_SHARE, Share
from hal0d.shares.book import ShareBook

# Retry-After hint: a queue usually moves within a couple of seconds (a load: fates.py's).
QUEUE_RETRY_AFTER_S: Final = 2.0

log = structlog.get_logger(__name__)


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


class SlotObserver(Protocol):
    """Who a slot tells its changes (lifecycle/observers.py: the manager's, then every
    subscriber's)."""

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState,
                      reason: str | None) -> None: ...

    def counts_changed(self, slot: Slot) -> None: ...


@dataclass(frozen=True, slots=True)
class Lease:
    slot: Slot
    queue_ms: float
    load_ms: float = 0.0  # the part of queue_ms spent waiting for the slot's model to load
    turn_ms: float = 0.0  # of load_ms, the wait for the model's turn in its group (a swap's)


class Slot(ProcessFates):
    def __init__(
        self,
        config: SlotLimits,
        *,
        observer: SlotObserver | None = None,
        state: SlotState = SlotState.OFFLINE,
        book: ShareBook | None = None,
    ) -> None:
        self.config = config
        self.name = config.name
        self.state = state
        self.reason: str | None = None
        self.in_flight = 0
        # Of in_flight, the interactive requests: batch work never swaps this model out while
        # there are any (hal0d/shares).
        self.interactive_in_flight = 0
        self.book = book if book is not None else ShareBook()
        # Told each change of state and of counts; set by the lifecycle manager, once.
        self.observer = observer
        # Set by the lifecycle manager on an on-demand slot: told when a request finds it
        # stopped, so that it loads the slot.
        self.demand: Callable[[Slot], None] | None = None
        # After a failed load: (monotonic time before which no new load is tried, its cause);
        # after an exit (hold), the same with no such time. While it is set, a slot in ERROR
        # grants nothing: no process of hal0d's listens there. Cleared once a start answers.
        self.load_refused: tuple[float, str] | None = None
        # Set by the lifecycle manager on a slot whose process it runs: returns True once that
        # process's exit is seen (its restart is the slot's to wait for), False when it still
        # runs (a refused connect is then the upstream's own answer).
        self.exit_seen: Callable[[Slot], Awaitable[bool]] | None = None
        # Set by the lifecycle manager on a slot whose process it runs: whether that process
        # runs now (asked of the kernel, not of what the lifecycle was told so far).
        self.process_runs: Callable[[Slot], bool] | None = None
        # Which run of the slot's process it serves: one more each time the lifecycle launches
        # one (for a slot without a command: each time its probe sees the server come back),
        # so that what was learnt of an earlier process (modes.py, props.py) is asked anew.
        self.generation = 0
        # Set by the lifecycle manager on a member of a group: True while the slot is to take
        # none of its queue (its work is batch alone and a load with interactive work comes
        # next in its group: that load may unload it, and what it took would drain first).
        self.hold_grants: Callable[[Slot], bool] | None = None
        # Set by the lifecycle manager in a group whose loads wait for their turn: the longest
        # that wait may be, added to a waiter's bound while the slot is not up.
        self.turn_wait_s = 0.0
        # While the slot's load waits for its turn in its group: since when (monotonic); after,
        # the last such wait (began, ended), which the requests that waited through it count.
        self.turn_began: float | None = None
        self.last_turn: tuple[float, float] | None = None
        self._drained: list[asyncio.Future[None]] = []
        # The leases whose connect was refused, waiting for their process's fate: resolved True
        # when the slot is up again, False when its start failed or it goes down.
        self._fates: list[asyncio.Future[bool]] = []
        # Only pending futures; a future leaves the queue before it is resolved, except a
        # cancelled one, which lingers until its task runs or the pump skips it.
        self._waiters = ClientQueue(self.book)

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
        if self._fates:
            self._tell_fates(old, new, event)
        if new is old:
            if reason is not None:
                self.reason = reason
            return rule
        self.state = new
        self.reason = reason
        self._notify(old, new, reason)
        if new is SlotState.OFFLINE:
            self._fail_waiters()
        elif new in GRANTABLE and old not in GRANTABLE:
            self._pump()
        return rule

    def _notify(self, old: SlotState, new: SlotState, reason: str | None) -> None:
        if self.observer is not None:
            # A broken hook must not wedge admission halfway through a grant or a release.
            try:
                self.observer.state_changed(self, old, new, reason)
            except Exception:
                log.exception("slot.listener_failed", slot=self.name, old=old, new=new)

    # -- what the lifecycle manager asks of admission ---------------------------------------

    def refuse_loads(self, cause: str, retry_after_s: float, *, backoff: bool = True) -> None:
        """A load failed: every waiter gets SlotLoadFailed with `cause` at once, and so do new
        requests until the backoff has passed (none with `backoff` False: the group had no
        room, which is no failure of the model's)."""
        if backoff:
            self.load_refused = (time.monotonic() + retry_after_s, cause)
        self.fail_waiters(SlotLoadFailed(self._load_failure(cause), retry_after=retry_after_s))

    def allow_loads(self) -> None:
        """A start answered: no failure refuses requests any more."""
        self.load_refused = None

    def hold(self, cause: str) -> None:
        """Its process exited and is started again: nothing is granted until the new one answers
        (nothing listens there meanwhile, and another program that took the port must not
        answer for the slot), and requests wait in the queue for it."""
        self.load_refused = (time.monotonic(), cause)

    def _held(self) -> bool:
        return self.state is SlotState.ERROR and self.load_refused is not None

    def _load_failure(self, cause: str) -> str:
        """A client's message: the cause without the upstream's address (its process's last
        lines may name it)."""
        cause = without_address(cause, self.config.upstream)
        return f"slot {self.name!r} could not load its model: {cause}"

    def fail_waiters(self, error: Hal0Error) -> None:
        """Every queued request gets `error` (a forced unload)."""
        while self._waiters:
            fut = self._waiters.popleft().fut
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

    def lease(self, client: str = ANONYMOUS, share: Share = DEFAULT_SHARE) -> LeaseContext:
        """``async with slot.lease() as lease:`` holds one unit of capacity for the block;
        `client` is whose turn the request waits for in the queue, `share` its key's."""
        return LeaseContext(self, client, share)

    # -- what the group's turns and the keepalive read of the queue (turns.py) --------------

    def rank(self, now: float | None = None) -> Rank | None:
        return self._waiters.rank(now)

    def urgent(self, now: float | None = None) -> bool:
        """Whether the slot has interactive work (or batch work past its bound), queued or in
        flight: batch work elsewhere does not swap it out."""
        return self.interactive_in_flight > 0 or self._waiters.urgent(now)

    def overdue_at(self) -> float | None:
        return self._waiters.overdue_at()

    def ahead(self, fut: asyncio.Future[None] | None) -> int | None:
        return None if fut is None else self._waiters.ahead(fut)

    def queued_by_account(self) -> dict[str, int]:
        return self._waiters.queued_by_account()

    def _can_grant(self) -> bool:
        return (self.state in GRANTABLE and self.in_flight < self.config.max_concurrent
                and not self._held()
                and (self.hold_grants is None or not self.hold_grants(self)))

    def regrant(self) -> None:
        """Grants what may be granted now (the manager, when what held the grants changed)."""
        self._pump()

    def _counts(self) -> None:
        if self.observer is not None:
            self.observer.counts_changed(self)

    def _take(self, batch: bool) -> None:
        """One unit granted (counted here, at the grant: a lease's task may run later)."""
        self.in_flight += 1
        if not batch:
            self.interactive_in_flight += 1
        if self.in_flight == 1:
            self.handle(Event.LEASED)
        self._counts()

    def _release(self, batch: bool) -> None:
        self.in_flight -= 1
        if not batch:
            self.interactive_in_flight -= 1
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
            waiter = self._waiters.popleft()
            if waiter.fut.done():
                continue
            waiter.fut.set_result(None)
            self._take(waiter.share.batch)

    def _refusal(self, what: str) -> QueueFull | SlotLoading:
        if self.state in LOADING:
            return SlotLoading(
                f"slot {self.name!r} is still loading ({self.state}): {what}",
                retry_after=LOADING_RETRY_AFTER_S,
            )
        if self._held():
            return SlotLoading(
                f"slot {self.name!r} waits for its process to start again "
                f"({without_address(str(self.reason), self.config.upstream)}): "
                f"{what}", retry_after=LOADING_RETRY_AFTER_S)
        return QueueFull(f"slot {self.name!r}: {what}", retry_after=QUEUE_RETRY_AFTER_S)

    def _wait_bound(self, *, loading: bool, batch: bool = False) -> float:
        """How long a request may wait for the slot: its queue_timeout_s, and for an on-demand
        slot that loads, the load's time and its turn in the group when longer; batch work,
        which waits behind interactive work, batch_max_wait_s more."""
        timeout_s = self.config.queue_timeout_s
        if loading and self.demand is not None:
            timeout_s = max(timeout_s, self.config.load_timeout_s) + self.turn_wait_s
        return timeout_s + self.book.batch_max_wait_s if batch else timeout_s

    def _offline(self) -> SlotLoading:
        return SlotLoading(f"slot {self.name!r} is offline", retry_after=LOADING_RETRY_AFTER_S)

    async def _acquire(self, client: str = ANONYMOUS, share: Share = DEFAULT_SHARE,
                       lease: LeaseContext | None = None) -> None:
        if self.state is SlotState.OFFLINE:
            raise self._offline()
        # Only with nobody queued: a newcomer never overtakes a waiter, even at the instant
        # a unit frees up.
        if not self._waiters and self._can_grant():
            self._take(share.batch)
            return
        if self.state in REFUSING and self.load_refused is not None:
            not_before, cause = self.load_refused
            if time.monotonic() < not_before:
                raise SlotLoadFailed(
                    self._load_failure(cause), retry_after=not_before - time.monotonic()
                )
        if len(self._waiters) >= self.config.max_queue:
            raise self._refusal(f"queue is full ({self.config.max_queue} waiting)")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut, client, share)
        if lease is not None:
            lease.waiter = fut
        self._counts()
        # Normally a no-op (units are handed over on release); it only matters if cancelled
        # futures still linger at the head while a unit is free, which must not strand us.
        self._pump()
        # An on-demand slot that loads (or waits for its restart): the request waits for the
        # load it asks for, or joins.
        timeout_s = self._wait_bound(loading=self.state in LOADING or self._held(),
                                     batch=share.batch)
        if self.state is SlotState.STOPPED and self.demand is not None:
            self.demand(self)
        timer = loop.call_later(timeout_s, self._expire, fut, timeout_s)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Granted and cancelled in the same instant: the unit is ours, pass it on.
                self._release(share.batch)
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
            fut = self._waiters.popleft().fut
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


class LeaseContext:
    __slots__ = ("_client", "_held", "_share", "_slot", "_started", "waiter")

    def __init__(self, slot: Slot, client: str = ANONYMOUS, share: Share = DEFAULT_SHARE
                 ) -> None:
        self._slot = slot
        self._client = client
        self._share = share
        self._started = time.monotonic()
        self._held = False
        # Its place in the slot's queue while it waits (None when granted at once).
        self.waiter: asyncio.Future[None] | None = None

    def ahead(self) -> int | None:
        """How many requests go before this one, while it waits (turns.py)."""
        return self._slot.ahead(self.waiter)

    async def __aenter__(self) -> Lease:
        slot = self._slot
        loading = slot.state in LOADING
        await slot._acquire(self._client, self._share, self)
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
            self._slot._release(self._share.batch)
