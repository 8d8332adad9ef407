"""Request history: one SQLite row per finished request, written off the hot path.

Handlers call ``HistoryWriter.submit(record)``, which only puts the record on a bounded queue and
returns; it never blocks and never raises. A writer task drains the queue in batches and commits
each batch in one transaction on a dedicated single-thread executor, so one connection is only
ever touched by one thread and a slow disk delays the history, never a stream. When the queue is
full the row is dropped and counted in ``dropped``: losing a history row is cheaper than holding
a request.

Durability: WAL with ``synchronous=NORMAL`` and a commit per batch, so every batch committed
before a kill -9 is in the file (NORMAL may lose the last commits on power loss, not on a crash of
the process). Rows older than ``retention_days`` are pruned at start and then at most once per
``prune_interval_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import math
import operator
import os
import sqlite3
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Final, TypeVar

import structlog

log = structlog.get_logger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class RequestRecord:
    """One history row: the one definition of the table's columns (the schema is built from
    these fields, their SQL types from the annotations), filled by name from the request's
    RequestInfo (hal0d.observability.requestinfo), whose fields carry the same names. New fields
    go last."""

    ts: float  # unix time
    request_id: str
    slot: str | None
    model: str | None
    endpoint: str
    stream: bool
    status: int
    ok: bool
    error_code: str | None = None
    queue_ms: float | None = None
    ttft_ms: float | None = None
    total_ms: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    load_ms: float | None = None  # the part of queue_ms spent waiting for a model to load
    key: str | None = None  # the name of the [[keys]] entry it came with (never the secret)
    attempts: int | None = None  # the slots a route tried (1 without a hand-on)
    failover: str | None = None  # the slots that handed it on and why: `box1=connect_refused`
    turn_ms: float | None = None  # of load_ms, the wait for the model's turn in its group
    cached_tokens: int | None = None  # of prompt_tokens, those the upstream's prompt cache held
    context_tokens: int | None = None  # the context a `context_exceeded` prompt did not fit
    dropped_messages: int | None = None  # the oldest messages left out to fit (Ollama's surface)
    service_class: str | None = None  # its key's class: interactive or batch (hal0d/shares)
    charged_tokens: int | None = None  # the tokens counted against its key (its quotas, shares)


COLUMNS: Final[tuple[str, ...]] = tuple(f.name for f in dataclasses.fields(RequestRecord))
# A row's values in column order, from a RequestRecord or anything with its fields (the request's
# RequestInfo): one call in C rather than a loop over the names.
row_of: Final = operator.attrgetter(*COLUMNS)


@dataclass(slots=True)
class LifecycleRow:
    """One event of a slot's life (a load, its end, an unload, a swap's step), kept so the
    status page's last hour survives a restart (observability/timeline.py)."""

    ts: float  # unix time
    slot: str
    kind: str
    detail: str  # the event's other fields, as JSON


_LIFECYCLE_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS lifecycle (\n    id INTEGER PRIMARY KEY,\n"
    "    ts REAL NOT NULL,\n    slot TEXT NOT NULL,\n    kind TEXT NOT NULL,\n"
    "    detail TEXT NOT NULL\n);\n"
    "CREATE INDEX IF NOT EXISTS lifecycle_ts ON lifecycle (ts);\n"
)
_INSERT_LIFECYCLE: Final = "INSERT INTO lifecycle (ts, slot, kind, detail) VALUES (?, ?, ?, ?)"
_SELECT_LIFECYCLE: Final = (
    "SELECT ts, slot, kind, detail FROM lifecycle WHERE ts >= ? ORDER BY ts, id"
)

_SQL_TYPES: Final = {"str": "TEXT", "float": "REAL", "int": "INTEGER", "bool": "INTEGER"}


def _sql_type(field: dataclasses.Field[Any]) -> str:
    """`float | None` -> `REAL`, `str` -> `TEXT NOT NULL` (annotations are strings here)."""
    kind, _, nullable = str(field.type).partition(" | ")
    return _SQL_TYPES[kind] + ("" if nullable else " NOT NULL")


_COLUMN_TYPES: Final = {f.name: _sql_type(f) for f in dataclasses.fields(RequestRecord)}
_SCHEMA: Final = (
    "CREATE TABLE IF NOT EXISTS requests (\n    id INTEGER PRIMARY KEY,\n"
    + ",\n".join(f"    {name} {kind}" for name, kind in _COLUMN_TYPES.items())
    + "\n);\nCREATE INDEX IF NOT EXISTS requests_ts ON requests (ts);\n"
)
# Columns later versions added: a database an earlier version wrote gains them in place at open
# (ALTER TABLE keeps every row; old rows read NULL there).
_ADDED_COLUMNS: Final = ("load_ms", "key", "attempts", "failover", "turn_ms", "cached_tokens",
                               "context_tokens", "dropped_messages", "service_class",
                               "charged_tokens")

_INSERT: Final = (
    f"INSERT INTO requests ({', '.join(COLUMNS)}) VALUES ({', '.join('?' for _ in COLUMNS)})"
)
_SELECT_RECENT: Final = (
    f"SELECT id, {', '.join(COLUMNS)} FROM requests ORDER BY ts DESC, id DESC LIMIT ?"
)
_SELECT_RECENT_OF_KEY: Final = (
    f"SELECT id, {', '.join(COLUMNS)} FROM requests WHERE key = ? "
    "ORDER BY ts DESC, id DESC LIMIT ?"
)
_SELECT_FAILED_SINCE: Final = "SELECT ts FROM requests WHERE ts >= ? AND ok = 0 ORDER BY ts, id"
_SELECT_FOR_MINUTES: Final = (
    "SELECT ts, slot, ok, queue_ms, ttft_ms, total_ms, completion_tokens FROM requests "
    "WHERE ts >= ? ORDER BY ts, id"
)
_BOOLEAN_COLUMNS: Final = ("stream", "ok")
_SELECT_CHARGED_SINCE: Final = (
    "SELECT key, SUM(charged_tokens) FROM requests WHERE ts >= ? AND key IS NOT NULL "
    "AND charged_tokens IS NOT NULL GROUP BY key"
)


class HistoryInUse(Exception):
    """Another hal0d keeps its request history in this file."""


def hold_lock(path: Path) -> IO[str]:
    """An exclusive lock on `<database>.lock`, held while the history is open: two hal0d on one
    file would mix their rows and each list the other's requests as its own, so the second is
    refused (HistoryInUse, naming the holder's pid)."""
    lock = path.with_name(path.name + ".lock").open("a+")
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip()
        lock.close()
        by = f" (pid {holder})" if holder else ""
        raise HistoryInUse(f"the request history {path} is in use by another hal0d{by}; "
                           "give each its own [metrics] database") from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"{os.getpid()}\n")
    lock.flush()
    return lock


class HistoryWriter:
    def __init__(
        self,
        path: Path,
        *,
        retention_days: int = 30,
        batch_size: int = 256,
        max_pending: int = 10_000,
        prune_interval_s: float = 3600.0,
        linger_s: float = 0.25,
    ) -> None:
        self.path = Path(path)
        self.retention_days = retention_days
        self.batch_size = max(1, batch_size)
        self.prune_interval_s = prune_interval_s
        # After a row arrives the writer lingers this long for more: one transaction (and one
        # thread hop) per request would cost each request ~170 us of CPU; batched, ~7 us a row.
        self.linger_s = linger_s
        self._wake = asyncio.Event()  # a full batch, a flush or a close ends the linger early
        self.dropped = 0  # rows refused because the queue was full or the writer closed
        self.failed = 0  # rows lost to a failed write (disk full, I/O error)
        self.written = 0
        self.batches = 0
        self._queue: asyncio.Queue[RequestRecord | LifecycleRow] = asyncio.Queue(
            maxsize=max_pending)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hal0d-history")
        self._conn: sqlite3.Connection | None = None
        self._lock: IO[str] | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # flush() waits on counters, not on queue.join(): under steady traffic the queue may
        # never be empty, but everything submitted before the flush is done at some point.
        self._submitted = 0
        self._done = 0
        self._progress = asyncio.Condition()
        self._last_prune = 0.0
        self._dropping = False

    @property
    def pending(self) -> int:
        return self._queue.qsize()

    # -- the hot path ------------------------------------------------------------------------

    def submit(self, record: RequestRecord | LifecycleRow) -> None:
        if self._closed:
            self.dropped += 1
            return
        try:
            self._queue.put_nowait(record)
        except asyncio.QueueFull:
            self.dropped += 1
            if not self._dropping:
                # Once per episode of overload, not once per row.
                self._dropping = True
                log.warning("history.dropping", pending=self._queue.qsize(), path=str(self.path))
            return
        self._submitted += 1
        if self._queue.qsize() >= self.batch_size:
            self._wake.set()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError("HistoryWriter already started")
        await self._run(self._open)
        await self._run(self._prune)
        self._last_prune = time.monotonic()
        self._task = asyncio.create_task(self._write_loop(), name="hal0d-history-writer")

    async def flush(self) -> None:
        """Return once every row submitted before this call is committed (or failed)."""
        if self._task is None:
            raise RuntimeError("HistoryWriter not started")
        target = self._submitted
        self._wake.set()
        async with self._progress:
            await self._progress.wait_for(lambda: self._done >= target)

    async def close(self) -> None:
        if self._closed:
            return
        # Refuse new rows first, so the flush below covers everything that was accepted.
        self._closed = True
        if self._task is not None:
            await self.flush()
            self._task.cancel()
            # gather, not `suppress(CancelledError)`: a cancellation aimed at our caller must
            # still reach it.
            await asyncio.gather(self._task, return_exceptions=True)
        if self._conn is not None:
            await self._run(self._close_conn)
        self._executor.shutdown(wait=True)

    async def recent(self, limit: int, key: str | None = None, since: float | None = None,
                     until: float | None = None) -> list[dict[str, Any]]:
        """Newest rows first, as the admin API shows them; only the named key's with `key`, only
        those that ended from `since` and before `until` (unix times) when given."""
        return await self._run(self._select_recent, max(0, limit), key, since, until)

    async def minutes(self, since: float, bucket_s: int = 60) -> list[dict[str, Any]]:
        """The requests that ended from `since` on, per slot and per `bucket_s` (see
        `per_bucket`): what the status page's charts and GET /api/timeline show."""
        return await self._run(self._select_minutes, since, bucket_s)

    async def failed_since(self, since: float) -> list[float]:
        """When the failed requests from `since` (unix time) on ended, oldest first: the
        status page's "errors, last hour", which a restart must not forget."""
        return await self._run(self._select_failed_since, since)

    async def charged_since(self, since: float) -> dict[str, int]:
        """Each key's charged tokens from `since` (unix time) on: its quotas' counts, read back
        at start (shares/quotas.py)."""
        return await self._run(self._select_charged_since, since)

    async def lifecycle_since(self, since: float) -> list[LifecycleRow]:
        """The slots' lifecycle events from `since` (unix time) on, oldest first."""
        return await self._run(self._select_lifecycle, since)

    # -- the writer task ---------------------------------------------------------------------

    async def _write_loop(self) -> None:
        while True:
            if time.monotonic() - self._last_prune >= self.prune_interval_s:
                await self._prune_logged()
            # Wake for the next prune even when idle: old rows age out without new traffic.
            try:
                next_prune = self._last_prune + self.prune_interval_s
                async with asyncio.timeout(next_prune - time.monotonic()):
                    first = await self._queue.get()
            except TimeoutError:
                continue
            if self.linger_s > 0 and not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.linger_s):
                        await self._wake.wait()
            self._wake.clear()
            batch = [first]
            while len(batch) < self.batch_size:
                try:
                    batch.append(self._queue.get_nowait())
                except asyncio.QueueEmpty:
                    break
            try:
                await self._run(self._insert, batch)
                self.written += len(batch)
                self.batches += 1
            except Exception:
                # A full or broken disk costs history rows, never the writer task itself.
                self.failed += len(batch)
                log.exception("history.write_failed", rows=len(batch), path=str(self.path))
            if self._queue.empty():
                self._dropping = False
            async with self._progress:
                self._done += len(batch)
                self._progress.notify_all()

    async def _prune_logged(self) -> None:
        # Stamped before the attempt: a failing prune is retried next interval, not in a loop.
        self._last_prune = time.monotonic()
        try:
            await self._run(self._prune)
        except Exception:
            log.exception("history.prune_failed", path=str(self.path))

    # -- the worker thread: the only place the connection is touched ---------------------------

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = hold_lock(self.path)
        # Autocommit mode: transactions are explicit, one per batch.
        conn = sqlite3.connect(self.path, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.executescript(_SCHEMA)
        conn.executescript(_LIFECYCLE_SCHEMA)
        have = {row[1] for row in conn.execute("PRAGMA table_info(requests)")}
        for name in _ADDED_COLUMNS:
            if name not in have:
                conn.execute(f"ALTER TABLE requests ADD COLUMN {name} {_COLUMN_TYPES[name]}")
                log.info("history.migrated", path=str(self.path), added_column=name)
        self._conn = conn

    def _db(self) -> sqlite3.Connection:
        if self._conn is None:
            raise RuntimeError("HistoryWriter not started")
        return self._conn

    def _insert(self, batch: list[RequestRecord | LifecycleRow]) -> None:
        conn = self._db()
        rows = [row_of(record) for record in batch if isinstance(record, RequestRecord)]
        events = [(row.ts, row.slot, row.kind, row.detail) for row in batch
                  if isinstance(row, LifecycleRow)]
        conn.execute("BEGIN")
        try:
            conn.executemany(_INSERT, rows)
            if events:
                conn.executemany(_INSERT_LIFECYCLE, events)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _prune(self) -> int:
        if self.retention_days <= 0:
            return 0
        cutoff = time.time() - self.retention_days * 86400
        conn = self._db()
        # The lifecycle's events are read back for an hour; a day is kept for a look by hand.
        conn.execute("DELETE FROM lifecycle WHERE ts < ?", (max(cutoff, time.time() - 86400),))
        return conn.execute("DELETE FROM requests WHERE ts < ?", (cutoff,)).rowcount

    def _select_lifecycle(self, since: float) -> list[LifecycleRow]:
        return [LifecycleRow(*row) for row in self._db().execute(_SELECT_LIFECYCLE, (since,))]

    def _select_recent(self, limit: int, key: str | None, since: float | None,
                       until: float | None) -> list[dict[str, Any]]:
        if since is None and until is None:
            if key is None:
                cursor = self._db().execute(_SELECT_RECENT, (limit,))
            else:
                cursor = self._db().execute(_SELECT_RECENT_OF_KEY, (key, limit))
        else:
            where = ["ts >= ?", "ts < ?"]
            args: list[object] = [since or 0.0, until or float("inf")]
            if key is not None:
                where.append("key = ?")
                args.append(key)
            cursor = self._db().execute(
                f"SELECT id, {', '.join(COLUMNS)} FROM requests WHERE {' AND '.join(where)} "
                "ORDER BY ts DESC, id DESC LIMIT ?", (*args, limit))
        names = [d[0] for d in cursor.description]
        out = []
        for row in cursor.fetchall():
            item = dict(zip(names, row, strict=True))
            for column in _BOOLEAN_COLUMNS:
                item[column] = bool(item[column])
            out.append(item)
        return out

    def _select_charged_since(self, since: float) -> dict[str, int]:
        rows = self._db().execute(_SELECT_CHARGED_SINCE, (since,)).fetchall()
        return {str(key): int(tokens) for key, tokens in rows}

    def _select_failed_since(self, since: float) -> list[float]:
        rows = self._db().execute(_SELECT_FAILED_SINCE, (since,)).fetchall()
        return [float(row[0]) for row in rows]

    def _select_minutes(self, since: float, bucket_s: int) -> list[dict[str, Any]]:
        return per_bucket(self._db().execute(_SELECT_FOR_MINUTES, (since,)), bucket_s)

    def _close_conn(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._lock is not None:
            self._lock.close()  # the lock goes with it
            self._lock = None


def percentile(ordered: list[float], p: float) -> float | None:
    """The nearest-rank percentile of sorted values (p95 of 20 values is the 19th): always a
    value that was measured, never one between two."""
    if not ordered:
        return None
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def tokens_per_s(completion_tokens: int | None, ttft_ms: float | None,
                 total_ms: float | None) -> float | None:
    """A request's generation speed from its history row: its completion tokens over the time
    after the first token. Only a stream has a TTFT, so a whole answer has no speed."""
    if not completion_tokens or ttft_ms is None or not total_ms:
        return None
    generating_s = (total_ms - ttft_ms) / 1000
    return completion_tokens / generating_s if generating_s > 0 else None


def _spread(values: list[float], digits: int = 1) -> dict[str, float | None]:
    values.sort()
    return {"p50": _rounded(percentile(values, 50), digits),
            "p95": _rounded(percentile(values, 95), digits)}


def _rounded(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def per_bucket(rows: Iterable[tuple[Any, ...]], bucket_s: int) -> list[dict[str, Any]]:
    """(ts, slot, ok, queue_ms, ttft_ms, total_ms, completion_tokens) rows, oldest first, as one
    entry per slot and bucket that had requests: `ts` (the bucket's start), `slot`, `requests`,
    `ok`, `errors`, and the p50 and p95 of `ttft_ms`, `tokens_per_s` and `queue_ms` among the
    requests that have one (null where none has)."""
    buckets: dict[tuple[float, str | None], dict[str, Any]] = {}
    for ts, slot, ok, queue_ms, ttft_ms, total_ms, completion_tokens in rows:
        start = float(ts // bucket_s * bucket_s)
        bucket = buckets.get((start, slot))
        if bucket is None:
            bucket = buckets[(start, slot)] = {"ts": start, "slot": slot, "requests": 0, "ok": 0,
                                               "errors": 0, "ttft": [], "speed": [], "queue": []}
        bucket["requests"] += 1
        bucket["ok" if ok else "errors"] += 1
        if ttft_ms is not None:
            bucket["ttft"].append(ttft_ms)
        if queue_ms is not None:
            bucket["queue"].append(queue_ms)
        speed = tokens_per_s(completion_tokens, ttft_ms, total_ms)
        if speed is not None:
            bucket["speed"].append(speed)
    out = []
    for bucket in buckets.values():
        ttft, speed, queue = bucket.pop("ttft"), bucket.pop("speed"), bucket.pop("queue")
        bucket["ttft_ms"] = _spread(ttft)
        bucket["tokens_per_s"] = _spread(speed)
        bucket["queue_ms"] = _spread(queue)
        out.append(bucket)
    out.sort(key=lambda bucket: (bucket["ts"], bucket["slot"] or ""))
    return out
