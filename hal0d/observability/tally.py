"""What the status page's header shows: requests served since start, and when the failed ones of
the last hour happened (the page counts them down as they age out, with no polling)."""

from __future__ import annotations

import collections
import time

HOUR_S = 3600.0


class Tally:
    def __init__(self) -> None:
        self.started = time.time()
        self.served = 0
        self._errors: collections.deque[float] = collections.deque()

    def add(self, ts: float, ok: bool) -> None:
        self.served += 1
        if not ok:
            self._errors.append(ts)
            self._prune()

    def error_times(self) -> list[float]:
        self._prune()
        return list(self._errors)

    def _prune(self) -> None:
        # Bounded by the error rate of one hour; a burst of errors is at most one float each.
        horizon = time.time() - HOUR_S
        while self._errors and self._errors[0] < horizon:
            self._errors.popleft()
