"""Connections that never finish their first request head: closed after `[server]
header_timeout_s`.

aiohttp bounds an idle keep-alive connection (its keepalive timeout, `[server] keepalive_timeout_s`,
which also ends one that sent part of a later head), but nothing bounds the wait for a connection's
first head: 800 connections that each send half a request hold 800 descriptors for as long as they
like, no key asked. `HeadWatch` looks at the server's connections four times a second (aiohttp's
`Server.connections`) and closes each one that has had no request since it was first seen longer
than the bound ago; the lifecycle middleware tells it which connections sent a whole head
(`served`). Queued requests, slow bodies and streams are requests already: never touched.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, Final

from hal0d.logs import get_logger

log = get_logger()

SWEEP_EVERY_S: Final = 0.25
# served() forgets the closed connections it holds once it holds this many (without a sweep,
# in-process, nothing else would).
FORGET_AT: Final = 1024
# A burst of closes is one log line (with how many) at most this often.
REPORT_EVERY_S: Final = 10.0


class HeadWatch:
    __slots__ = ("_first_seen", "_reported", "_served", "_unreported", "closed_total",
                 "timeout_s")

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # a reload may change it
        self.closed_total = 0  # for /metrics
        self._unreported = 0
        self._reported = 0.0
        # aiohttp's connection objects (they take no weak reference), forgotten once closed: a
        # sweep keeps the ones still open, served() drops closed ones past FORGET_AT.
        self._served: set[Any] = set()
        self._first_seen: dict[Any, float] = {}

    def served(self, connection: Any) -> None:
        """`connection` sent a whole request head (the lifecycle middleware)."""
        self._served.add(connection)
        if len(self._served) > FORGET_AT:
            self._served = {kept for kept in self._served if kept.transport is not None}

    def sweep(self, connections: Iterable[Any], now: float) -> int:
        """Closes the connections with no request past the bound; how many it closed."""
        closed = 0
        open_now = set(connections)
        self._served &= open_now
        self._first_seen = {c: t for c, t in self._first_seen.items() if c in open_now}
        for connection in open_now:
            if connection in self._served:
                continue
            first_seen = self._first_seen.setdefault(connection, now)
            if now - first_seen >= self.timeout_s:
                connection.force_close()
                closed += 1
        if closed:
            self.closed_total += closed
            self._unreported += closed
        if self._unreported and now - self._reported >= REPORT_EVERY_S:
            log.warning("server.header_timeout", closed=self._unreported,
                        header_timeout_s=self.timeout_s,
                        hint="connections that sent no whole request head in time")
            self._unreported = 0
            self._reported = now
        return closed

    async def run(self, connections: Callable[[], Iterable[Any]]) -> None:
        """Sweeps every SWEEP_EVERY_S until cancelled."""
        while True:
            await asyncio.sleep(SWEEP_EVERY_S)
            self.sweep(list(connections()), time.monotonic())
