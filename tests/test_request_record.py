"""A request's fields are defined once: the history row (RequestRecord) names the columns, the
schema, the recorder and the request.done line are derived from it."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from pathlib import Path

from hal0d.observability.history import COLUMNS, HistoryWriter
from hal0d.observability.recorder import done_fields, record_of
from hal0d.observability.requestinfo import RequestInfo


def test_every_history_column_is_filled_from_the_request_info_by_name() -> None:
    info = RequestInfo(request_id="r1", endpoint="/v1/chat/completions")
    info.end()
    missing = [name for name in COLUMNS if not hasattr(info, name)]
    assert missing == []


async def test_the_table_has_exactly_the_record_columns(tmp_path: Path) -> None:
    writer = HistoryWriter(tmp_path / "h.db")
    await writer.start()
    await writer.close()
    with closing(sqlite3.connect(tmp_path / "h.db")) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(requests)")]
        not_null = {row[1] for row in conn.execute("PRAGMA table_info(requests)") if row[3]}
    assert columns == ["id", *COLUMNS]
    assert not_null == {"ts", "request_id", "endpoint", "stream", "status", "ok"}


def test_the_request_done_line_carries_every_column_but_ts() -> None:
    info = RequestInfo(request_id="r1", endpoint="/v1/chat/completions")
    info.queue_ms = 1.23456
    info.end()
    fields = done_fields(record_of(info))
    assert set(fields) == {*COLUMNS, "duration_ms"} - {"ts", "total_ms"}
    assert fields["queue_ms"] == 1.23
    assert fields["duration_ms"] == round(info.total_ms, 2)
