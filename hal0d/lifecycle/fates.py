"""A lease whose connect was refused: the slot's process may have died that instant.

The kernel closes a dead process's sockets before its parent learns of the exit, so a lease may
be granted in the instant between. Such a lease does not connect once its process is gone
(`process_gone`: another program may listen on the port by then) and, refused, waits for the
process's fate (`process_fate`) as a queued request waits for its restart. Slot (slots.py) has
this as a part of itself; the lifecycle tells the fate by the slot's state changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

from hal0d.errors import SlotLoadFailed, SlotLoading
from hal0d.lifecycle.machine import Event
from hal0d.lifecycle.vocabulary import DOWN, UP, SlotState

# A model load takes a few seconds: a client asked to come back waits about that long.
LOADING_RETRY_AFTER_S: Final = 5.0


class ProcessFates:
    """Slot's part that waits for its process's fate (the module's docstring)."""

    name: str
    state: SlotState
    load_refused: tuple[float, str] | None
    exit_seen: Callable[[Any], Awaitable[bool]] | None
    process_runs: Callable[[Any], bool] | None
    _fates: list[asyncio.Future[bool]]

    def _wait_bound(self, *, loading: bool, batch: bool = False) -> float:
        raise NotImplementedError

    def _load_failure(self, cause: str) -> str:
        raise NotImplementedError

    def process_gone(self) -> bool:
        """Called under a lease before it connects: True when the slot's process, one hal0d
        runs, is not running, though its exit may not be told yet (the lease was granted in
        that instant). Whatever listens on its port then is not the slot's (another program may
        have taken it): the lease must not connect, and waits for process_fate instead."""
        return self.process_runs is not None and not self.process_runs(self)

    async def process_fate(self) -> bool:
        """Called under a lease whose connect to the upstream was refused. For a slot whose
        process hal0d runs, that process may have died just now: the request waits for its fate
        within the bound a request queued now would have, and True says the slot is up again
        (send once more); SlotLoadFailed or SlotLoading (503 with Retry-After) when its restart
        failed, it was unloaded or replaced, or it was not up again in time. False at once for
        a slot without a process of hal0d's, and after a short grace when the process still
        runs: the refusal is then the upstream's own answer."""
        if self.exit_seen is None:
            return False
        fate: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._fates.append(fate)
        try:
            if not await self.exit_seen(self):
                return False
            bound_s = self._wait_bound(loading=True)
            try:
                async with asyncio.timeout(bound_s):
                    up = await fate
            except TimeoutError:
                raise SlotLoading(
                    f"slot {self.name!r}: its process exited and was not up again within "
                    f"{bound_s:g}s", retry_after=LOADING_RETRY_AFTER_S) from None
        finally:
            with contextlib.suppress(ValueError):
                self._fates.remove(fate)
        if up:
            return True
        if self.load_refused is not None and (left := self.load_refused[0] - time.monotonic()) > 0:
            raise SlotLoadFailed(self._load_failure(self.load_refused[1]), retry_after=left)
        raise SlotLoading(f"slot {self.name!r} lost its process and is {self.state} now",
                          retry_after=LOADING_RETRY_AFTER_S)

    def _tell_fates(self, old: SlotState, new: SlotState, event: Event) -> None:
        """The process's fate, to the leases waiting for it (told before the step is taken, a
        step into the same state too): up again once a start answers; not when the start failed
        (error from starting), or the slot goes down, is unloaded or replaced (that drain waits
        for these leases)."""
        if new in UP and old not in UP:
            up = True
        elif (new in DOWN or event in (Event.REPLACE, Event.UNLOAD)
              or (new is SlotState.ERROR and old is SlotState.STARTING)):
            up = False
        else:
            return  # the exit itself, the relaunch: the fate is still to come
        fates, self._fates = self._fates, []
        for fate in fates:
            if not fate.done():
                fate.set_result(up)

