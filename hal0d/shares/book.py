"""The tokens each account (a key) used lately: what a slot's queue and a group's turns weigh
keys by, and what the page draws for the last hour.

One writer: the request's end charges its tokens (prompt and generated, as its answer's usage
counts them). The readers are the queues, on each grant: `used()` is O(1) but for the buckets
that just left the window.

The share window slides in tenths of itself (a 600 s window drops 60 s of use at a time); the
page's hour in minutes. Monotonic time: a clock step does not make or lose anyone's use.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Final

HOUR_BUCKETS: Final = 60
MINUTE_S: Final = 60.0
WINDOW_BUCKETS: Final = 10


@dataclass(slots=True)
class _Use:
    """One account's use: its buckets in the share window (index, tokens) and their total; its
    minutes of the last hour (minute, tokens)."""

    window: collections.deque[list[int]] = field(default_factory=collections.deque)
    total: int = 0
    hour: collections.deque[list[int]] = field(default_factory=collections.deque)


class ShareBook:
    """The accounts' use over the share window, and the two settings of [dispatcher] that the
    queues read with it (a reload sets them with `configure`)."""

    __slots__ = ("_bucket_s", "_uses", "batch_max_wait_s", "window_s")

    def __init__(self, window_s: float = 600.0, batch_max_wait_s: float = 120.0) -> None:
        self._uses: dict[str, _Use] = {}
        self.window_s = window_s
        self.batch_max_wait_s = batch_max_wait_s
        self._bucket_s = window_s / WINDOW_BUCKETS

    def configure(self, window_s: float, batch_max_wait_s: float) -> None:
        if window_s != self.window_s:
            # Buckets of another width mean nothing in the new window: its use starts afresh.
            for use in self._uses.values():
                use.window.clear()
                use.total = 0
            self.window_s, self._bucket_s = window_s, window_s / WINDOW_BUCKETS
        self.batch_max_wait_s = batch_max_wait_s

    def charge(self, account: str, tokens: int, now: float | None = None) -> None:
        """`tokens` used by `account` now."""
        if tokens <= 0:
            return
        now = time.monotonic() if now is None else now
        use = self._uses.get(account)
        if use is None:
            use = self._uses[account] = _Use()
        _add(use.window, int(now // self._bucket_s), tokens)
        use.total += tokens
        _add(use.hour, int(now // MINUTE_S), tokens)
        while use.hour[0][0] <= int(now // MINUTE_S) - HOUR_BUCKETS:
            use.hour.popleft()

    def used(self, account: str, now: float | None = None) -> int:
        """The tokens `account` used over the share window."""
        use = self._uses.get(account)
        if use is None:
            return 0
        now = time.monotonic() if now is None else now
        oldest = int(now // self._bucket_s) - WINDOW_BUCKETS
        window = use.window
        while window and window[0][0] <= oldest:
            use.total -= window.popleft()[1]
        return use.total

    def last_hour(self, account: str, now: float | None = None) -> list[int]:
        """`account`'s tokens in each minute of the last hour, oldest first (60 numbers)."""
        now = time.monotonic() if now is None else now
        minute = int(now // MINUTE_S)
        series = [0] * HOUR_BUCKETS
        for at, tokens in self._uses[account].hour if account in self._uses else ():
            age = minute - at
            if 0 <= age < HOUR_BUCKETS:
                series[HOUR_BUCKETS - 1 - age] += tokens
        return series


def _add(buckets: collections.deque[list[int]], index: int, tokens: int) -> None:
    if buckets and buckets[-1][0] == index:
        buckets[-1][1] += tokens
    else:
        buckets.append([index, tokens])
