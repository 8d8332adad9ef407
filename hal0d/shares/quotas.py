"""Token quotas: what a key may use in an hour and in a day (`tokens_per_hour`,
`tokens_per_day`), counted from each answer's usage and kept across restarts.

A request that would start with its key at or past a quota is refused (QuotaExceeded, 429) with
the time the quota's window resets, as Retry-After and in words. A request already begun is
never cut: a stream that crosses its quota mid-answer finishes, and its tokens count.

The windows are the calendar's, in the machine's local time: an hour from its :00, a day from
midnight, as a person reads "10,000 tokens a day".

Where the counts live is one small interface (`TokenCounts`), so that a shared store can replace
hal0d's own when several hal0d share keys. hal0d's own (`LocalCounts`) keeps the running totals
of the current hour and day in memory; they are read back from the request history (its
`charged_tokens` column, SQLite) when hal0d starts, so a restart forgets nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Final, Protocol

from hal0d.errors import QuotaExceeded

HOUR: Final = "hour"
DAY: Final = "day"


def window_of(per: str, now: float) -> tuple[float, float]:
    """The calendar window `per` (HOUR, DAY) that unix time `now` is in, in local time: its
    start and its end (the next one's start), as unix times."""
    local = time.localtime(now)
    if per == HOUR:
        start = time.mktime((*local[:4], 0, 0, 0, 0, -1))
        return start, time.mktime((*local[:3], local[3] + 1, 0, 0, 0, 0, -1))
    start = time.mktime((*local[:3], 0, 0, 0, 0, 0, -1))
    return start, time.mktime((local[0], local[1], local[2] + 1, 0, 0, 0, 0, 0, -1))


class TokenCounts(Protocol):
    """Each key's tokens in the current hour and day, wherever they are kept."""

    def add(self, key: str, tokens: int, at: float) -> None:
        """`tokens` used by `key` at unix time `at`."""

    def used(self, key: str, per: str, now: float) -> int:
        """What `key` used in the window `per` that `now` is in."""


class LocalCounts:
    """TokenCounts of one hal0d: the running totals of each key's current hour and day. The
    history keeps every request's charged tokens; `seed` puts back what it says of the
    current windows when hal0d starts."""

    def __init__(self) -> None:
        # (key, per) -> [window start, tokens]
        self._totals: dict[tuple[str, str], list[float]] = {}
        self._windows: dict[str, tuple[float, float]] = {}

    def _window(self, per: str, now: float) -> tuple[float, float]:
        cached = self._windows.get(per)
        if cached is None or not cached[0] <= now < cached[1]:
            cached = self._windows[per] = window_of(per, now)
        return cached

    def seed(self, per: str, start: float, totals: dict[str, int]) -> None:
        """What the history holds of each key's tokens since `start`, the start of the current
        window `per`."""
        for key, tokens in totals.items():
            self._totals[(key, per)] = [start, float(tokens)]

    def add(self, key: str, tokens: int, at: float) -> None:
        for per in (HOUR, DAY):
            start = self._window(per, at)[0]
            total = self._totals.get((key, per))
            if total is None or total[0] != start:
                self._totals[(key, per)] = [start, float(tokens)]
            else:
                total[1] += tokens

    def used(self, key: str, per: str, now: float) -> int:
        total = self._totals.get((key, per))
        if total is None or total[0] != self._window(per, now)[0]:
            return 0
        return int(total[1])


@dataclass(frozen=True, slots=True)
class Quota:
    per: str  # HOUR or DAY
    tokens: int

    @property
    def setting(self) -> str:
        return f"tokens_per_{self.per}"


def check(key: str, quotas: tuple[Quota, ...], counts: TokenCounts,
          now: float | None = None) -> None:
    """QuotaExceeded when `key` used one of its `quotas` whole (the one that resets last, when
    both are: the request can start only then)."""
    now = time.time() if now is None else now
    spent = [(quota, counts.used(key, quota.per, now)) for quota in quotas]
    over = [(quota, used) for quota, used in spent if used >= quota.tokens]
    if not over:
        return
    quota, used = max(over, key=lambda pair: window_of(pair[0].per, now)[1])
    resets = window_of(quota.per, now)[1]
    when = time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(resets))
    raise QuotaExceeded(
        f"key {key!r} used {used} tokens this {quota.per}, its {quota.setting} is "
        f"{quota.tokens}; it resets at {when} (in {_span(resets - now)})",
        retry_after=max(1.0, resets - now))


def _span(seconds: float) -> str:
    minutes = max(1, round(seconds / 60))
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min" if hours else f"{minutes} min"
