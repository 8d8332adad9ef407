"""A key's name where hal0d tells of its requests, over real sockets: the history, the event feed,
/metrics, the request.done line and `hal0d requests --key`, never its secret; and a reload
(SIGHUP) that adds a key lets it in, named, while the loaded slot keeps its process."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import textwrap
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from tests.harness.daemons import Hal0dProcess, ServerFactory, launch, stop
from tests.harness.keys import (
    ADMIN_KEY,
    INFERENCE_KEY,
    ONE_AT_A_TIME_KEY,
    READ_KEY,
    SECRETS,
    bearer,
    call,
    chat,
    start_keyed,
)
from tests.harness.ports import free_port
from tests.harness.processes import stub_pids
from tests.harness.stubs import Stub


async def test_a_keyed_request_names_its_key_in_history_metrics_and_event_feed(
    start_hal0d: ServerFactory, stub: Stub, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_keyed(start_hal0d, stub, tmp_path)
    async with http.get(hal0d.make_url("/api/events"), headers=bearer(READ_KEY)) as feed:
        status, _, _ = await call(http, hal0d, "POST", "/v1/chat/completions", INFERENCE_KEY,
                                  body=chat("plain"))
        assert status == 200
        status, _, _ = await call(http, hal0d, "POST", "/v1/chat/completions",
                                  ONE_AT_A_TIME_KEY, body=chat("chat"))
        assert status == 200

        async def request_events() -> list[dict[str, Any]]:
            seen: list[dict[str, Any]] = []
            name = None
            async for line in feed.content:
                if line.startswith(b"event:"):
                    name = line[6:].strip()
                elif line.startswith(b"data:") and name == b"request":
                    seen.append(json.loads(line[5:]))
                    if len(seen) == 2:
                        return seen
            return seen

        events = await asyncio.wait_for(request_events(), 5)
    assert [event["key"] for event in events] == ["laptop", "agent"], events

    status, answer, _ = await call(http, hal0d, "GET", "/api/requests", READ_KEY)
    assert [row["key"] for row in answer["requests"]][:2] == ["agent", "laptop"]
    status, answer, _ = await call(http, hal0d, "GET", "/api/requests?key=laptop", READ_KEY)
    assert [(row["key"], row["model"]) for row in answer["requests"]] == [("laptop", "plain")]
    status, text, _ = await call(http, hal0d, "GET", "/metrics", READ_KEY)
    assert 'key="laptop"' in text and 'key="agent"' in text
    assert not any(secret in text for secret in SECRETS)


@pytest.fixture
async def keyed_process(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Hal0dProcess]]]:
    """A real `hal0d serve` (a SIGHUP reload needs one), stopped after the test."""
    started: list[Hal0dProcess] = []

    async def start(upstream: str, **options: Any) -> Hal0dProcess:
        started.append(await launch(tmp_path, upstream, **options))
        return started[-1]

    yield start
    for hal0d in started:
        await stop(hal0d.process)


async def test_a_sighup_that_adds_a_key_lets_it_in_while_the_loaded_slot_keeps_its_process(
    stub: Stub, keyed_process: Callable[..., Awaitable[Hal0dProcess]], http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    port = free_port()
    command = ["hal0d", "stub", "--port", str(port), "--log", str(tmp_path / "slot.log")]
    slot = f"""
        [[slots]]
        name = "proc"
        upstream = "http://127.0.0.1:{port}"
        models = ["chat"]
        command = {orjson.dumps(command).decode()}
        start = "on_demand"
    """
    first = textwrap.dedent(f"""
        [[keys]]
        name = "laptop"
        key = "{INFERENCE_KEY}"
        scopes = ["inference", "read"]
    """)
    hal0d = await keyed_process(stub.url, slot=slot, extra=first)
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(INFERENCE_KEY)) as resp:
        assert resp.status == 200, await resp.text()
    [pid] = stub_pids(str(tmp_path))
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(ADMIN_KEY)) as resp:
        assert resp.status == 401

    added = textwrap.dedent("""
        [[keys]]
        name = "phone"
        key_file = "phone.key"
        scopes = ["inference"]
    """)
    (hal0d.config.parent / "phone.key").write_text(f"{ADMIN_KEY}\n")
    hal0d.config.write_text(hal0d.config.read_text() + added)
    hal0d.send(signal.SIGHUP)
    reloaded = await hal0d.wait_for_event("config.reloaded")
    assert reloaded["slots_changed"] == [] and reloaded["keys"] == 2, reloaded
    async with http.post(f"{hal0d.url}/v1/chat/completions", json=chat("chat"),
                         headers=bearer(ADMIN_KEY)) as resp:
        assert resp.status == 200, await resp.text()
    assert stub_pids(str(tmp_path)) == {pid}
    async with http.get(f"{hal0d.url}/api/slots", headers=bearer(INFERENCE_KEY)) as resp:
        [view] = (await resp.json())["slots"]
    assert (view["state"], view["pid"]) == ("ready", pid)

    done = [event for event in hal0d.named("request.done")
            if event.get("path") == "/v1/chat/completions"]
    assert [event.get("key") for event in done] == ["laptop", None, "phone"], done
    # The command line finds a key with `read` in the config (laptop's) and filters by name.
    listed = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "requests", "--config", str(hal0d.config),
        "--key", "phone", stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await listed.communicate()
    assert listed.returncode == 0, err.decode()
    [header, row] = out.decode().splitlines()
    assert header.split()[:4] == ["TIME", "REQUEST", "KEY", "SLOT"]
    assert row.split()[2:5] == ["phone", "proc", "chat"], row
    log = hal0d.log.read_text()
    for secret in (INFERENCE_KEY, ADMIN_KEY):
        assert secret not in log
