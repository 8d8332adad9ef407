"""What a daemon reports of what it did, read from outside: /metrics (by prometheus_client's own
parser), the history (the API and the SQLite file), the per-slot figures, and its log's times."""

from __future__ import annotations

import sqlite3
from contextlib import closing
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import hdrs
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.harness.client import Served
from tests.harness.daemons import Hal0dProcess
from tests.harness.poll import eventually


async def get_json(http: aiohttp.ClientSession, hal0d: Served, path: str) -> Any:
    async with http.get(hal0d.make_url(path)) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def slot_metrics(
    http: aiohttp.ClientSession,
    hal0d: Served,
    name: str = "llm",
    requests: int = 1,
    timeout: float = 2.0,
) -> dict[str, Any]:
    """The slot's /api/slots/metrics entry once it has recorded `requests` requests."""
    async def recorded() -> dict[str, Any]:
        slots = (await get_json(http, hal0d, "/api/slots/metrics"))["slots"]
        entry = next(s for s in slots if s["name"] == name)
        assert entry["requests"] >= requests, entry
        return dict(entry)

    return await eventually(recorded, timeout, f"{requests} requests recorded for {name!r}")


async def db_row(path: Path, request_id: str, timeout: float = 2.0) -> dict[str, Any]:
    """The row as the SQLite file holds it, read with a connection of our own once it is there."""
    def written() -> dict[str, Any] | None:
        if not path.exists():
            return None
        with closing(sqlite3.connect(path)) as conn:
            conn.row_factory = sqlite3.Row
            row = conn.execute(
                "SELECT * FROM requests WHERE request_id = ?", (request_id,)
            ).fetchone()
        return dict(row) if row is not None else None

    return await eventually(written, timeout, f"a row for {request_id} in {path}")


async def api_row(
    http: aiohttp.ClientSession, hal0d: Served, request_id: str, timeout: float = 2.0
) -> dict[str, Any]:
    """The row GET /api/requests gives for `request_id`, once it is there."""
    async def written() -> dict[str, Any]:
        rows = (await get_json(http, hal0d, "/api/requests?limit=100"))["requests"]
        found = [row for row in rows if row["request_id"] == request_id]
        assert found, rows
        return dict(found[0])

    return await eventually(written, timeout, f"the history row of {request_id}")


def headers(request_id: str) -> dict[str, str]:
    """The header that names a request's id: its history row is found by it."""
    return {"X-Request-Id": request_id}


async def scrape(http: aiohttp.ClientSession, hal0d: Served) -> dict[str, list[Sample]]:
    """GET /metrics parsed by prometheus_client: samples by sample name."""
    async with http.get(hal0d.make_url("/metrics")) as resp:
        assert resp.status == 200
        assert resp.headers[hdrs.CONTENT_TYPE].startswith("text/plain")
        text = await resp.text()
    samples: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append(sample)
    return samples


def value(samples: dict[str, list[Sample]], name: str, **labels: str) -> float | None:
    found = [s.value for s in samples.get(name, []) if labels.items() <= s.labels.items()]
    assert len(found) <= 1, (name, labels, found)
    return found[0] if found else None


async def after_the_stream(http: aiohttp.ClientSession, hal0d: Hal0dProcess, event: str,
                           slot: str) -> bool:
    """Whether `event` for `slot` was logged after the streamed request ended: the end is the
    request's history row (its start and its duration), the event's time its line's."""
    async with http.get(f"{hal0d.url}/api/requests") as response:
        rows = (await response.json())["requests"]
    streamed = next(row for row in rows if row["stream"])
    ended = streamed["ts"] + streamed["total_ms"] / 1000
    [logged] = [datetime.fromisoformat(e["timestamp"]).timestamp() for e in hal0d.events()
                if e["event"] == event and e.get("slot") == slot]
    return logged >= ended
