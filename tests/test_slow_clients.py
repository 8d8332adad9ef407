"""Slow and half-sent clients against a real `hal0d serve`: a connection that never finishes its
first request head is closed after `[server] header_timeout_s` while requests beside it are
served at once; an idle keep-alive connection lasts `keepalive_timeout_s`, not the head's bound.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.harness.client import chat_body
from tests.harness.daemons import Hal0dProcess, launch, stop
from tests.harness.stubs import Stub

HALF_SENT = 800
HEADER_TIMEOUT_S = 2.0
KEEPALIVE_S = 4.0
SERVER = f"""
    header_timeout_s = {HEADER_TIMEOUT_S}
    keepalive_timeout_s = {KEEPALIVE_S}
"""


@pytest.fixture
async def hal0d(stub: Stub, tmp_path: Path) -> AsyncIterator[Hal0dProcess]:
    """A real `hal0d serve` (its own runner and keep-alive, as in production) with the bounds."""
    served = await launch(tmp_path, stub.url, server=SERVER)
    yield served
    await stop(served.process)


async def closed_by_peer(reader: asyncio.StreamReader) -> float:
    """When the other side closed the connection (EOF or a reset), in monotonic time."""
    try:
        while await reader.read(4096):
            pass
    except ConnectionError:
        pass
    return time.monotonic()


def closed_total(metrics: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(metrics)
               for sample in family.samples
               if sample.name == "hal0d_connections_closed_total"
               and sample.labels.get("reason") == "header_timeout")


async def test_half_sent_request_heads_are_closed_after_header_timeout_s_while_others_are_served(
    hal0d: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{hal0d.port}\r\n".encode()
    connections = []
    for _ in range(HALF_SENT):
        reader, writer = await asyncio.open_connection("127.0.0.1", hal0d.port)
        writer.write(head)  # and nothing more: no blank line, no body
        connections.append((reader, writer))
    opened = time.monotonic()
    watching = [asyncio.create_task(closed_by_peer(reader)) for reader, _ in connections]
    try:
        started = time.monotonic()
        async with http.post(f"{hal0d.url}/v1/chat/completions",
                             json=chat_body("chat", stream=False)) as resp:
            assert resp.status == 200
            await resp.read()
        assert time.monotonic() - started < 1.0  # served at once beside them
        closed_at = await asyncio.wait_for(asyncio.gather(*watching), HEADER_TIMEOUT_S + 5)
    finally:
        for _, writer in connections:
            writer.close()
    # Not before the bound, and all of them within it and a second (they were opened over
    # a moment; the bound counts from each one's start).
    assert min(closed_at) - opened >= HEADER_TIMEOUT_S - 1.0, min(closed_at) - opened
    assert max(closed_at) - opened <= HEADER_TIMEOUT_S + 1.0, max(closed_at) - opened
    async with http.get(f"{hal0d.url}/metrics") as resp:
        assert closed_total(await resp.text()) == HALF_SENT
    logged = await hal0d.wait_for_event("server.header_timeout")
    assert logged["header_timeout_s"] == HEADER_TIMEOUT_S and logged["closed"] >= 1
    # One line for the burst, not one per connection.
    assert len(hal0d.named("server.header_timeout")) <= 2


async def test_an_idle_keep_alive_connection_lasts_keepalive_timeout_s_not_the_head_bound(
    hal0d: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", hal0d.port)
    try:
        writer.write(f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{hal0d.port}\r\n\r\n".encode())
        status = await reader.readline()
        assert status.startswith(b"HTTP/1.1 200"), status
        answered = time.monotonic()
        closed_at = await asyncio.wait_for(closed_by_peer(reader), KEEPALIVE_S + 5)
    finally:
        writer.close()
    idle = closed_at - answered
    assert KEEPALIVE_S - 0.5 <= idle <= KEEPALIVE_S + 2.0, idle
    async with http.get(f"{hal0d.url}/metrics") as resp:
        assert closed_total(await resp.text()) == 0  # closed as idle, not for its head
