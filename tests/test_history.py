"""Request history: rows land in a real SQLite file, in batches, off the hot path; kill -9
loses none."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

from hal0d.observability.history import HistoryWriter, RequestRecord
from tests.harness.poll import eventually

REPO = Path(__file__).resolve().parent.parent
DAY = 86400.0


def record(i: int, *, ts: float | None = None, ok: bool = True) -> RequestRecord:
    return RequestRecord(
        ts=time.time() + i * 0.001 if ts is None else ts,
        request_id=f"req-{i}",
        slot="llm",
        model="qwen",
        endpoint="/v1/chat/completions",
        stream=i % 2 == 0,
        status=200 if ok else 502,
        ok=ok,
        error_code=None if ok else "dispatch.upstream_unavailable",
        queue_ms=1.5,
        ttft_ms=42.0 if ok else None,
        total_ms=100.0 + i,
        prompt_tokens=10,
        completion_tokens=i,
    )


def count_rows(path: Path, where: str = "1") -> int:
    with closing(sqlite3.connect(path)) as conn:
        return int(conn.execute(f"SELECT count(*) FROM requests WHERE {where}").fetchone()[0])


async def test_rows_are_written_and_read_back_newest_first(writer: HistoryWriter) -> None:
    for i in range(5):
        writer.submit(record(i, ok=i != 3))
    await writer.flush()
    rows = await writer.recent(3)
    assert [r["request_id"] for r in rows] == ["req-4", "req-3", "req-2"]
    failed = rows[1]
    assert failed["ok"] is False and failed["stream"] is False
    assert failed["status"] == 502
    assert failed["error_code"] == "dispatch.upstream_unavailable"
    assert failed["ttft_ms"] is None
    assert rows[0]["ok"] is True and rows[0]["stream"] is True
    assert rows[0]["completion_tokens"] == 4
    assert isinstance(rows[0]["id"], int)
    assert set(rows[0]) == {"id", *RequestRecord.__dataclass_fields__}


async def test_newest_means_by_timestamp_not_by_arrival(writer: HistoryWriter) -> None:
    now = time.time()
    writer.submit(record(1, ts=now))
    writer.submit(record(2, ts=now - 60))  # a long request that finished last, started first
    await writer.flush()
    assert [r["request_id"] for r in await writer.recent(10)] == ["req-1", "req-2"]


async def test_whatever_is_queued_is_written_in_batches(tmp_path: Path) -> None:
    w = HistoryWriter(tmp_path / "h.db", batch_size=256)
    await w.start()
    for i in range(600):
        w.submit(record(i))
    assert w.pending == 600
    await w.flush()
    assert (w.batches, w.written, w.pending) == (3, 600, 0)
    await w.close()
    assert count_rows(tmp_path / "h.db") == 600


async def test_flushed_rows_are_committed_for_other_readers(writer: HistoryWriter) -> None:
    for i in range(10):
        writer.submit(record(i))
    await writer.flush()
    assert count_rows(writer.path) == 10


async def test_a_full_queue_drops_and_counts_rows(tmp_path: Path) -> None:
    w = HistoryWriter(tmp_path / "h.db", max_pending=5)
    await w.start()
    for i in range(12):
        w.submit(record(i))  # no await in between: the writer cannot drain
    assert w.dropped == 7
    await w.flush()
    assert [r["request_id"] for r in await w.recent(100)] == [f"req-{i}" for i in range(4, -1, -1)]
    w.submit(record(99))
    await w.close()
    w.submit(record(100))
    assert w.dropped == 8
    assert count_rows(tmp_path / "h.db") == 6


async def test_a_failed_batch_is_counted_and_the_writer_carries_on(writer: HistoryWriter) -> None:
    bad = record(1)
    bad.request_id = None  # type: ignore[assignment]  # NOT NULL: the whole batch rolls back
    writer.submit(bad)
    await writer.flush()
    assert (writer.failed, writer.written) == (1, 0)
    writer.submit(record(2))
    await writer.flush()
    assert [r["request_id"] for r in await writer.recent(10)] == ["req-2"]


async def test_rows_past_retention_are_pruned_at_start(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    now = time.time()
    first = HistoryWriter(path)
    await first.start()
    first.submit(record(1, ts=now - 40 * DAY))
    first.submit(record(2, ts=now - 29 * DAY))
    first.submit(record(3, ts=now))
    await first.close()
    assert count_rows(path) == 3

    second = HistoryWriter(path, retention_days=30)
    await second.start()
    assert [r["request_id"] for r in await second.recent(10)] == ["req-3", "req-2"]
    await second.close()


async def test_pruning_recurs_even_when_idle(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    w = HistoryWriter(path, retention_days=1, prune_interval_s=0.05)
    await w.start()
    w.submit(record(1))
    await w.flush()
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute("UPDATE requests SET ts = ?", (time.time() - 2 * DAY,))
    await eventually(lambda: count_rows(path) == 0, 2.0, "the old row pruned while idle")
    assert count_rows(path) == 0
    await w.close()


_KILLED_WRITER = """
import asyncio, os, sys, time
from pathlib import Path
from hal0d.observability.history import HistoryWriter, RequestRecord

async def main() -> None:
    w = HistoryWriter(Path(sys.argv[1]), batch_size=16)
    await w.start()
    for i in range(50):
        w.submit(RequestRecord(time.time(), f"req-{i}", "llm", "qwen", "/v1/x", False, 200, True))
    await w.flush()
    print("flushed", flush=True)
    os.kill(os.getpid(), 9)

asyncio.run(main())
"""


def test_committed_rows_survive_kill_9(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _KILLED_WRITER, str(path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        check=False,
        text=True,
        timeout=30,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert proc.stdout.strip() == "flushed"
    # Never checkpointed: the rows are only in the WAL, which the next reader recovers.
    assert (tmp_path / "h.db-wal").exists()
    assert count_rows(path) == 50
    assert count_rows(path, "request_id = 'req-49'") == 1


# The requests table as the version before model loading wrote it (no load_ms column).
PREVIOUS_SCHEMA = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, request_id TEXT NOT NULL, slot TEXT, model TEXT,
    endpoint TEXT NOT NULL, stream INTEGER NOT NULL, status INTEGER NOT NULL, ok INTEGER NOT NULL,
    error_code TEXT, queue_ms REAL, ttft_ms REAL, total_ms REAL, prompt_tokens INTEGER,
    completion_tokens INTEGER
);
CREATE INDEX requests_ts ON requests (ts);
"""


async def test_a_database_of_a_previous_version_keeps_its_rows_and_gains_load_ms_and_key(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(PREVIOUS_SCHEMA)
        conn.executemany(
            "INSERT INTO requests (ts, request_id, slot, model, endpoint, stream, status, ok) "
            "VALUES (?, ?, 'llm', 'chat', '/v1/chat/completions', 0, 200, 1)",
            [(time.time() - 60 + i, f"old-{i}") for i in range(3)],
        )
        conn.commit()
    writer = HistoryWriter(path)
    await writer.start()
    try:
        new = record(9)
        new.load_ms, new.key = 812.5, "laptop"
        writer.submit(new)
        await writer.flush()
        rows = await writer.recent(10)
        of_key = await writer.recent(10, key="laptop")
    finally:
        await writer.close()
    assert [row["request_id"] for row in rows][-3:] == ["old-2", "old-1", "old-0"]
    assert [row["load_ms"] for row in rows] == [812.5, None, None, None]
    assert [row["key"] for row in rows] == ["laptop", None, None, None]
    assert [row["request_id"] for row in of_key] == [new.request_id]
    with closing(sqlite3.connect(path)) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(requests)")]
    added = ["load_ms", "key", "attempts", "failover", "turn_ms", "cached_tokens",
             "context_tokens", "dropped_messages", "service_class", "charged_tokens"]
    assert columns[-len(added):] == added
    assert all(columns.count(name) == 1 for name in added)


# The requests table as the version before the prompt's cached part was kept (turn_ms last).
CACHELESS_SCHEMA = """
CREATE TABLE requests (
    id INTEGER PRIMARY KEY, ts REAL NOT NULL, request_id TEXT NOT NULL, slot TEXT, model TEXT,
    endpoint TEXT NOT NULL, stream INTEGER NOT NULL, status INTEGER NOT NULL, ok INTEGER NOT NULL,
    error_code TEXT, queue_ms REAL, ttft_ms REAL, total_ms REAL, prompt_tokens INTEGER,
    completion_tokens INTEGER, load_ms REAL, key TEXT, attempts INTEGER, failover TEXT,
    turn_ms REAL
);
CREATE INDEX requests_ts ON requests (ts);
"""


async def test_a_database_of_the_version_before_gains_cached_tokens_in_place(
    tmp_path: Path,
) -> None:
    path = tmp_path / "old.db"
    with closing(sqlite3.connect(path)) as conn:
        conn.executescript(CACHELESS_SCHEMA)
        conn.execute(
            "INSERT INTO requests (ts, request_id, slot, model, endpoint, stream, status, ok, "
            "prompt_tokens, turn_ms) VALUES (?, 'old', 'llm', 'chat', '/v1/chat/completions', 0, "
            "200, 1, 900, 3.5)", (time.time() - 60,))
        conn.commit()
    writer = HistoryWriter(path)
    await writer.start()
    try:
        new = record(1)
        new.prompt_tokens, new.cached_tokens = 917, 903
        writer.submit(new)
        await writer.flush()
        rows = await writer.recent(10)
    finally:
        await writer.close()
    assert [(row["request_id"], row["prompt_tokens"], row["cached_tokens"]) for row in rows] == [
        (new.request_id, 917, 903), ("old", 900, None)]
    assert rows[1]["turn_ms"] == 3.5
    with closing(sqlite3.connect(path)) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(requests)")]
    assert columns[-6:] == ["turn_ms", "cached_tokens", "context_tokens", "dropped_messages",
                            "service_class", "charged_tokens"]


async def test_the_pages_errors_of_the_last_hour_are_the_historys_and_survive_a_restart(
    tmp_path: Path,
) -> None:
    """GET /api/status's error_times (the page's "errors, last hour") are read from the history:
    a restart keeps them, and a failure older than an hour is not among them."""
    import aiohttp

    from tests.harness.daemons import launch, stop
    from tests.harness.ports import free_port

    old = record(0, ts=time.time() - 2 * 3600, ok=False)
    writer = HistoryWriter(tmp_path / "history.sqlite3")
    await writer.start()
    writer.submit(old)
    await writer.close()
    nowhere = f"http://127.0.0.1:{free_port()}"
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}

    async with aiohttp.ClientSession() as http:
        first = await launch(tmp_path, nowhere)
        try:
            for _ in range(3):
                async with http.post(f"{first.url}/v1/chat/completions", json=chat) as resp:
                    assert resp.status >= 500  # nothing listens upstream
            async with http.get(f"{first.url}/api/status") as resp:
                before = (await resp.json())["error_times"]
        finally:
            await stop(first.process)
        assert len(before) == 3 and old.ts not in before, before

        second = await launch(tmp_path, nowhere)
        try:
            async with http.get(f"{second.url}/api/status") as resp:
                after = await resp.json()
        finally:
            await stop(second.process)
    assert after["error_times"] == before and after["requests"] == 0, after
