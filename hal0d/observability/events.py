"""The event feed: what happens to the slots, the loads and the requests, told to every reader of
GET /api/events as it happens.

Publishers (a slot's state change, a load's phase, a finished request) call ``EventHub.publish``,
which only appends the event's frame to each reader's own queue: it never awaits and never
blocks, so a slow reader cannot slow a stream, a load or another reader. Each queue is bounded
(``queue_size``); when a reader is that far behind, further events for it are dropped and
counted, and the count reaches it as a ``dropped`` event at the place of the gap, before the next
event it gets. A reader's queue is all there is of it: removing it (``unsubscribe``) leaves no
task behind.

Frames are encoded once per event (``event: NAME`` / ``data: JSON``), whatever the number of
readers. This module knows nothing of the HTTP side: the handler in handlers/admin.py writes the
frames, and ends the feed of a reader that takes none for as long as a stream's client may (a
full queue only drops events; a full socket would hold the handler for good). ``SlotFeed``
turns the slots', the lifecycle manager's and the recorder's happenings into events.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

import orjson

from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.slots import Slot
from hal0d.lifecycle.vocabulary import SlotState
from hal0d.protocol import sse

if TYPE_CHECKING:
    from hal0d.lifecycle.room import Swap
    from hal0d.lifecycle.vocabulary import LoadPhase, UnloadReason
    from hal0d.observability.history import RequestRecord

QUEUE_SIZE: Final = 1000
HEARTBEAT: Final = b": heartbeat\n\n"
COUNTS_EVERY_S: Final = 0.25


def frame(name: str, data: Any) -> bytes:
    """`data`: a dict, or a dataclass (orjson writes its fields as an object)."""
    return sse.encode(name, orjson.dumps(data))


class Subscriber:
    """One reader's queue of frames, bounded; what did not fit is counted in `dropped`."""

    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self.dropped = 0  # over the reader's whole life
        self.closed = False
        self._frames: collections.deque[bytes] = collections.deque()
        self._unreported = 0  # dropped since the reader was last told
        self._wakeup = asyncio.Event()

    def offer(self, data: bytes) -> None:
        if len(self._frames) >= self.queue_size:
            self.dropped += 1
            self._unreported += 1
            return
        if self._unreported:
            # The gap is told where it happened: the reader learns of it before this event.
            self._frames.append(self._gap())
        self._frames.append(data)
        self._wakeup.set()

    def _gap(self) -> bytes:
        gap = frame("dropped", {"dropped": self._unreported, "dropped_total": self.dropped})
        self._unreported = 0
        return gap

    def close(self) -> None:
        self.closed = True
        self._wakeup.set()

    async def next(self) -> bytes | None:
        """The next frame, waiting for one; None once the hub closed."""
        while True:
            if self._frames:
                return self._frames.popleft()
            if self._unreported:
                return self._gap()
            if self.closed:
                return None
            self._wakeup.clear()
            await self._wakeup.wait()

    @property
    def pending(self) -> int:
        return len(self._frames)


class EventHub:
    """Every reader of the feed, and the one way to tell them something."""

    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self.queue_size = queue_size
        self.subscribers: set[Subscriber] = set()
        self.closed = False

    def subscribe(self) -> Subscriber:
        subscriber = Subscriber(self.queue_size)
        if self.closed:
            subscriber.close()
        else:
            self.subscribers.add(subscriber)
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)

    def publish(self, name: str, data: Any) -> None:
        """`data` as `frame` takes it. A publisher whose data costs something to build asks
        `listened` first: most of the time nobody reads the feed."""
        if not self.subscribers:
            return  # nobody listens: not even the encoding is paid for
        encoded = frame(name, data)
        for subscriber in self.subscribers:
            subscriber.offer(encoded)

    @property
    def listened(self) -> bool:
        return bool(self.subscribers)

    def close(self) -> None:
        """hal0d is stopping: every reader gets what is queued, then the end of its stream (an
        open feed must not hold the shutdown for its whole grace)."""
        self.closed = True
        for subscriber in self.subscribers:
            subscriber.close()


SlotView = Callable[[Slot], dict[str, Any]]


class SlotViews(LifecycleObserver):
    """A slot's view as every reader gets it (/api/slots, the feed's `hello` and `slot` events):
    the lifecycle manager's view plus, while the slot loads, its load's phase (`load`: phase,
    elapsed_s, ts), which the manager tells only as events. So `hal0d status` and a page opened
    mid-load show "probing 12s", not a bare "starting"."""

    def __init__(self, view: SlotView) -> None:
        self.view = view
        self.loads: dict[str, dict[str, Any]] = {}

    def __call__(self, slot: Slot) -> dict[str, Any]:
        view = self.view(slot)
        view["load"] = self.loads.get(slot.name)
        return view

    # LifecycleObserver (lifecycle/manager.py)
    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        if str(phase) in ("ready", "failed", "withdrawn"):  # the load is over
            self.loads.pop(slot, None)
        else:
            self.loads[slot] = {"phase": str(phase), "elapsed_s": round(elapsed_s, 1),
                                "ts": time.time()}

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        self.loads.pop(slot, None)

    def swap(self, swap: Swap) -> None:
        """A swap shows in the views through pending_swap and its slots' states."""


class SlotFeed(LifecycleObserver):
    """Publishes `slot`, `load`, `unload`, `swap` and `request` events on a hub.

    Each `slot` event carries the slot's whole /api/slots view (`view`), so a reader can keep a
    page up to date from the events alone (the feed's handler starts it with every view)."""

    def __init__(self, hub: EventHub, view: SlotView) -> None:
        self.hub = hub
        self.view = view
        self._counting: dict[str, Slot] = {}  # slots whose counts changed since the last tell

    def counts_changed(self, slot: Slot) -> None:
        """in_flight or queued changed: told at most every COUNTS_EVERY_S per slot, so a busy
        slot costs the feed a few events a second, not one per lease."""
        if slot.name in self._counting or not self.hub.listened:
            return
        self._counting[slot.name] = slot
        asyncio.get_running_loop().call_later(COUNTS_EVERY_S, self._tell_counts, slot.name)

    def _tell_counts(self, name: str) -> None:
        slot = self._counting.pop(name, None)
        if slot is not None:
            self.hub.publish("counts", {"ts": time.time(), "slot": name,
                                        "in_flight": slot.in_flight, "queued": slot.queued})

    def state_changed(self, slot: Slot, old: SlotState, new: SlotState, reason: str | None
                      ) -> None:
        """Published with the slot's view (the lifecycle manager's own reactions come first,
        so the view already holds what it makes of the change)."""
        if not self.hub.listened:
            return  # a busy slot changes state twice a request: the view is built for readers only
        self.hub.publish("slot", {
            "ts": time.time(), "slot": slot.name, "old": str(old), "new": str(new),
            "reason": reason, "in_flight": slot.in_flight, "queued": slot.queued,
            "view": self.view(slot),
        })

    def slot_reconfigured(self, slot: Slot) -> None:
        """A reload changed the slot's config: its view, in a `slot` event with its state as
        it is (old = new)."""
        self.state_changed(slot, slot.state, slot.state, "reloaded")

    # LifecycleObserver (lifecycle/manager.py)
    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        self.hub.publish("load", {"ts": time.time(), "slot": slot, "phase": str(phase),
                                  "elapsed_s": elapsed_s, "reason": reason})

    def unloaded(self, slot: str, reason: UnloadReason, loaded_s: float | None) -> None:
        self.hub.publish("unload", {"ts": time.time(), "slot": slot, "reason": str(reason),
                                    "loaded_s": loaded_s})

    def swap(self, swap: Swap) -> None:
        self.hub.publish("swap", {
            "ts": time.time(), "group": swap.group, "phase": str(swap.phase), "slot": swap.slot,
            "victim": swap.victim, "waited_s": swap.waited_s, "why": swap.why,
            "policy": swap.policy, "max_wait_s": swap.max_wait_s,
        })

    def request_finished(self, row: RequestRecord) -> None:
        # The row as it is: orjson writes a dataclass's fields as an object, where
        # dataclasses.asdict deep-copies every field (~25 us a request).
        self.hub.publish("request", row)
