"""What the stub's app keeps for its handlers: the log each request writes its lines to (--log),
and the keys its shared objects are found under: the delay before each token, llama-server's
--alias names, the server slots and the context limit.
"""

from __future__ import annotations

import time
from pathlib import Path

from aiohttp import web

from hal0d_stub.context import ContextLimit
from hal0d_stub.slots import ServerSlots


class StubLog:
    """Line-per-event log, flushed at once so a test can read it while the stub runs."""

    def __init__(self, path: Path | None) -> None:
        self._file = path.open("a", buffering=1, encoding="utf-8") if path else None

    def write(self, line: str) -> None:
        if self._file is not None:
            self._file.write(f"{time.time():.3f} {line}\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


LOG_KEY = web.AppKey("stub_log", StubLog)
DELAY_KEY = web.AppKey("stub_delay", float)
ALIASES_KEY = web.AppKey("stub_aliases", tuple)
SLOTS_KEY = web.AppKey("stub_slots", ServerSlots)
CONTEXT_KEY = web.AppKey("stub_context", ContextLimit)
