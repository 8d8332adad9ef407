"""A slot's queue by client: whose turn it is among the requests waiting for one slot.

Round robin over the clients that have requests waiting (a client with nothing queued has no
turn), arrival order within one client: a burst of one client and the single request of another
alternate instead of the single one waiting behind the whole burst. The client of a request is
its key's name, else its body's `user`, else ANONYMOUS (observability/requestinfo.client_of).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass
from typing import Final

__all__ = ["ANONYMOUS", "ClientQueue"]

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
