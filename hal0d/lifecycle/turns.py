"""A slot's queue by share and client: whose turn it is among the requests waiting for one slot.

Each request carries its key's share (hal0d/shares): the account its tokens count in, its class,
its weight. The next to go is the head of the account ranked first:

    1. batch work that waited `batch_max_wait_s` (it is never starved), the longest waiting first
    2. interactive work
    3. batch work
    within one of these, the account that used the fewest tokens over the share window for its
    weight (ShareBook.used / weight), then the one granted least lately, then the oldest waiter

Within an account, round robin over its clients (a client with nothing queued has no turn),
arrival order within one client: a burst of one client and the single request of another
alternate instead of the single one waiting behind the whole burst. The client of a request is
its key's name, else its body's `user`, else ANONYMOUS (observability/requestinfo.client_of).
Without keys every request is in one account, and the queue is that round robin alone (first
come, first served when no body names a user).
"""

from __future__ import annotations

import asyncio
import collections
import time
from dataclasses import dataclass, field
from typing import Final

from hal0d.shares import DEFAULT_SHARE, Share
from hal0d.shares.book import ShareBook

__all__ = ["ANONYMOUS", "ClientQueue", "Rank", "Waiter"]

ANONYMOUS: Final = ""  # the client of every request that names none

# (tier, tokens used per weight, when last granted, oldest waiter's arrival): smaller goes first.
Rank = tuple[int, float, float, float]
OVERDUE, INTERACTIVE, BATCH = 0, 1, 2


@dataclass(eq=False, slots=True)
class Waiter:
    fut: asyncio.Future[None]
    client: str
    share: Share
    since: float  # monotonic


@dataclass(eq=False, slots=True)
class _Account:
    """One account's waiters, by client, with the clients' round robin."""

    share: Share
    by_client: dict[str, collections.deque[Waiter]] = field(default_factory=dict)
    turns: collections.deque[str] = field(default_factory=collections.deque)
    count: int = 0

    def oldest(self) -> float:
        return min(queue[0].since for queue in self.by_client.values())


class ClientQueue:
    """The waiters of one slot, by account and client (the module's docstring).

    Bounded by its slot (``max_queue``); every operation is O(accounts x clients) or O(one
    client's queue).
    """

    __slots__ = ("_accounts", "_book", "_count", "_granted", "_index")

    def __init__(self, book: ShareBook | None = None) -> None:
        self._book = book if book is not None else ShareBook()
        self._accounts: dict[str, _Account] = {}
        self._index: dict[asyncio.Future[None], Waiter] = {}
        self._count = 0
        # When each account was last granted here (monotonic): equal use alternates accounts.
        self._granted: dict[str, float] = {}

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def append(self, fut: asyncio.Future[None], client: str,
               share: Share = DEFAULT_SHARE) -> None:
        waiter = Waiter(fut, client, share, time.monotonic())
        account = self._accounts.get(share.account)
        if account is None:
            account = self._accounts[share.account] = _Account(share)
        account.share = share  # a reload may have changed the key's class or weight
        queue = account.by_client.get(client)
        if queue is None:
            queue = account.by_client[client] = collections.deque()
            account.turns.append(client)
        queue.append(waiter)
        account.count += 1
        self._index[fut] = waiter
        self._count += 1

    def popleft(self) -> Waiter:
        """The next waiter in turn (IndexError when empty); its client goes to the back of its
        account's round robin."""
        if not self._accounts:
            raise IndexError("nobody waits")
        if len(self._accounts) == 1:
            name = next(iter(self._accounts))
        else:
            now = time.monotonic()
            name = min(self._accounts, key=lambda name: self._rank(name, now))
            self._granted[name] = now
        account = self._accounts[name]
        client = account.turns.popleft()
        queue = account.by_client[client]
        waiter = queue.popleft()
        if queue:
            account.turns.append(client)
        else:
            del account.by_client[client]
        account.count -= 1
        if not account.count:
            del self._accounts[name]
        del self._index[waiter.fut]
        self._count -= 1
        return waiter

    def remove(self, fut: asyncio.Future[None]) -> None:
        """ValueError when `fut` is not queued."""
        waiter = self._index.pop(fut, None)
        if waiter is None:
            raise ValueError("not queued")
        account = self._accounts[waiter.share.account]
        queue = account.by_client[waiter.client]
        queue.remove(waiter)
        self._count -= 1
        account.count -= 1
        if not queue:
            del account.by_client[waiter.client]
            account.turns.remove(waiter.client)
        if not account.count:
            del self._accounts[waiter.share.account]

    def oldest_since(self) -> float | None:
        """When the longest-waiting request came (monotonic), or None with nobody waiting."""
        return min((account.oldest() for account in self._accounts.values()), default=None)

    # -- the ranks -------------------------------------------------------------------------

    def _tier(self, account: _Account, now: float) -> int:
        if not account.share.batch:
            return INTERACTIVE
        return OVERDUE if now - account.oldest() >= self._book.batch_max_wait_s else BATCH

    def _rank(self, name: str, now: float) -> Rank:
        account = self._accounts[name]
        tier = self._tier(account, now)
        if tier == OVERDUE:
            return (OVERDUE, 0.0, 0.0, account.oldest())
        used = self._book.used(name, now) / account.share.weight
        return (tier, used, self._granted.get(name, 0.0), account.oldest())

    def rank(self, now: float | None = None) -> Rank | None:
        """The rank of the request that goes next (None with nobody waiting): a group's turn
        goes to the slot whose next request ranks first."""
        now = time.monotonic() if now is None else now
        return min((self._rank(name, now) for name in self._accounts), default=None)

    def urgent(self, now: float | None = None) -> bool:
        """Whether interactive work (or batch work past its bound) waits here."""
        now = time.monotonic() if now is None else now
        return any(self._tier(account, now) != BATCH for account in self._accounts.values())

    def overdue_at(self) -> float | None:
        """When the oldest batch request here will have waited batch_max_wait_s (monotonic);
        None without batch work."""
        batch = [account.oldest() for account in self._accounts.values() if account.share.batch]
        return min(batch) + self._book.batch_max_wait_s if batch else None

    def ahead(self, fut: asyncio.Future[None], now: float | None = None) -> int | None:
        """About how many requests go before `fut` as the queue stands (None: not queued): those
        of the accounts ranked before its own, and in its own account the requests its clients'
        round robin serves first."""
        waiter = self._index.get(fut)
        if waiter is None:
            return None
        now = time.monotonic() if now is None else now
        mine = waiter.share.account
        own_rank = self._rank(mine, now)
        before = sum(account.count for name, account in self._accounts.items()
                     if name != mine and self._rank(name, now) < own_rank)
        account = self._accounts[mine]
        position = account.by_client[waiter.client].index(waiter)
        turns = list(account.turns)
        mine_at = turns.index(waiter.client)
        # The round robin serves each client before mine one more time than those after it.
        before += sum(min(len(account.by_client[client]), position + (index < mine_at))
                      for index, client in enumerate(turns) if index != mine_at)
        return before + position

    def queued_by_account(self) -> dict[str, int]:
        return {name: account.count for name, account in self._accounts.items()}
