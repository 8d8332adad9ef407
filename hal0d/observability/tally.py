"""What the status page's header counts in this process: requests served since start. Its
"errors, last hour" come from the history (HistoryWriter.failed_since), so a restart keeps them."""

from __future__ import annotations

import time

HOUR_S = 3600.0


class Tally:
    def __init__(self) -> None:
        self.started = time.time()
        self.served = 0

    def add(self) -> None:
        self.served += 1
