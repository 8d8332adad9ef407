"""What a finished request leaves behind: its `request.done` line and its record (the history row,
Prometheus, the live metrics, the event feed), done in batches after the answer has gone out.

The lifecycle middleware hands each finished request to `Finisher.add` and returns; `delay_s`
later the batch is worked through, one request per turn of the event loop, and only while no
request is being served (or once the batch has waited MAX_WAIT_S). Done right after each answer,
in the same turn of the loop as the answer, the line and the record measured about twice the CPU
they take this way (bench/README.md has the figures). A line's timestamp is therefore up to about
MAX_WAIT_S after its request ended; its `duration_ms` is exact.

Whoever reads what finished requests leave calls `flush()` first (the request history and metrics
APIs, /metrics, /api/status, the shutdown), so it sees every request that ended before it asked.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Final

from hal0d.logs import get_logger, info_line
from hal0d.metrics.history import COLUMNS
from hal0d.requestinfo import RequestInfo

if TYPE_CHECKING:
    from hal0d.metrics.recorder import Recorder

log = get_logger()

DELAY_S: Final = 0.02
# While requests are being served the batch waits (checking again every RECHECK_S) until its
# oldest request ended MAX_WAIT_S ago: the work is done between requests where it can be.
RECHECK_S: Final = 0.002
MAX_WAIT_S: Final = 0.1
# Requests done in one turn of the event loop: a batch is worked through in slices of this many,
# each its own callback, so a request that arrives meanwhile waits for one slice (~30 us), not for
# the whole batch. One: larger slices saved no CPU in `make bench` and lengthened its p99.
SLICE: Final = 1
# Polled by probes: noise in the log (their metrics still count).
UNLOGGED_PATHS: Final = frozenset({"/healthz", "/readyz"})
# The request.done line carries the history row's columns (metrics/history.py defines them) but
# `ts` (the line has its own time), with total_ms under the name the line always used.
_DONE_NAMES: Final = {name: "duration_ms" if name == "total_ms" else name
                      for name in COLUMNS if name != "ts"}


def is_dispatch_request(method: str, path: str) -> bool:
    """Requests for a model: the ones the history and the request metrics are about (not the
    GET /v1/models a chat front end polls)."""
    listing = method == "GET" and path.endswith("/models")
    return path.startswith(("/v1/", "/llm/")) and not listing


def done_fields(info: RequestInfo) -> dict[str, object]:
    fields = {}
    for column, name in _DONE_NAMES.items():
        value = getattr(info, column)
        fields[name] = round(value, 2) if isinstance(value, float) else value
    return fields


class Finisher:
    """Finished requests waiting for their line and their record, and the timer that does them."""

    __slots__ = ("_pending", "_timer", "active", "delay_s", "recorder")

    def __init__(self, *, delay_s: float = DELAY_S) -> None:
        self.delay_s = delay_s
        self.active = 0  # requests begun and not yet handed in
        # Set once the recorder runs (contexts.recorder_context); until then, lines only.
        self.recorder: Recorder | None = None
        self._pending: list[tuple[RequestInfo, str, str]] = []
        self._timer: asyncio.Handle | None = None

    @property
    def pending(self) -> int:
        return len(self._pending)

    def begin(self) -> None:
        """A request has begun (the middleware); `add` hands it in when it ends."""
        self.active += 1

    def add(self, info: RequestInfo, method: str, path: str) -> None:
        self.active -= 1
        self._pending.append((info, method, path))
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.delay_s, self._next_slice)

    def flush(self) -> None:
        """Every request handed in so far: its line written, its record made."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._pending = self._pending, []
        self._finish(batch)

    def _next_slice(self) -> None:
        loop = asyncio.get_running_loop()
        if not self._pending:
            self._timer = None
            return
        # The oldest request's end (RequestInfo.ended: time.monotonic, the loop's clock too).
        overdue = loop.time() - (self._pending[0][0].ended or 0.0) >= MAX_WAIT_S
        if self.active and not overdue:
            self._timer = loop.call_later(RECHECK_S, self._next_slice)  # a request is being served
            return
        # Overdue (requests are always being served): all of it at once, so that it keeps up
        # with requests that end faster than one a turn of the loop.
        take = len(self._pending) if overdue else SLICE
        batch, self._pending = self._pending[:take], self._pending[take:]
        self._timer = loop.call_soon(self._next_slice) if self._pending else None
        self._finish(batch)

    def _finish(self, batch: list[tuple[RequestInfo, str, str]]) -> None:
        if not batch:
            return
        # One logger for the batch: structlog's lazy proxy builds one for every call otherwise.
        logger = log.bind()
        recorder = self.recorder
        for info, method, path in batch:
            try:
                if recorder is not None and is_dispatch_request(method, path):
                    recorder.record(info)
                if path not in UNLOGGED_PATHS:
                    fields = {"method": method, "path": path, **done_fields(info)}
                    if not info_line("request.done", fields):
                        logger.info("request.done", **fields)
            except Exception:
                # One request's failure costs its own line or record, not the rest of the batch.
                log.exception("request.finish_failed", request_id=info.request_id, path=path)
