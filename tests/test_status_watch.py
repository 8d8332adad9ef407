"""`hal0d status --watch` keeps its counts as /api/slots has them: a second request in flight on a
slot that is already serving changes no state, only the feed's `counts` event says so, and the
screen shows it. Run as the real CLI against a real `hal0d serve`, its slot the real stub."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import eventually, free_port
from tests.test_cli import ROOT, env_without
from tests.test_cli_client import DEADLINE_S, KEY, QUIT_S, daemon_toml, hal0d, row_of, serving
from tests.test_server import Hal0d

CLEAR = "\x1b[H\x1b[2J"
AUTH = {"Authorization": f"Bearer {KEY}"}


@contextlib.asynccontextmanager
async def watching(daemon: Hal0d) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {**env_without("HAL0D_API_KEY"), "HAL0D_API_KEY": KEY}
    watcher = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", "status", "--watch", "--url", daemon.url, cwd=ROOT,
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    try:
        yield watcher
    finally:
        if watcher.returncode is None:
            watcher.kill()
            await watcher.wait()


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Hal0d]:
    """test_cli_client's daemon, its on-demand slot `a` also serving the stub's `chatty`."""
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(daemon_toml(tmp_path, port).replace('models = ["chat"]',
                                                          'models = ["chat", "chatty"]'))
    async for served in serving(config, port):
        yield served


async def test_status_watch_shows_a_second_request_in_flight_without_a_state_change(
    daemon: Hal0d, http: aiohttp.ClientSession
) -> None:
    code, _, err = await hal0d("load", "a", "--config", str(daemon.config))
    assert code == 0, err
    streams: list[aiohttp.ClientResponse] = []
    async with watching(daemon) as watcher:
        stdout = watcher.stdout
        assert stdout is not None
        seen = bytearray()

        async def in_flight(count: str) -> bool:
            with contextlib.suppress(TimeoutError):
                seen.extend(await asyncio.wait_for(stdout.read(65536), 0.2))
            screens = seen.decode(errors="replace").split(CLEAR)
            return len(screens) > 1 and row_of(screens[-1], "a")[3] == count

        await eventually(lambda: in_flight("0"), DEADLINE_S, "the first screen")
        # `chatty` streams for ever: each request stays in flight until it is closed here.
        body = {"model": "chatty", "stream": True,
                "messages": [{"role": "user", "content": "hi"}]}
        try:
            for count in ("1", "2"):
                resp = await http.post(f"{daemon.url}/v1/chat/completions", json=body,
                                       headers=AUTH)
                streams.append(resp)
                assert resp.status == 200
                await resp.content.readany()
                await eventually(lambda c=count: in_flight(c), DEADLINE_S,  # type: ignore[misc]
                                 f"{count} in flight on the screen")
            async with http.get(f"{daemon.url}/api/slots", headers=AUTH) as slots:
                assert (await slots.json())["slots"][0]["in_flight"] == 2
        finally:
            for resp in streams:
                resp.close()
        await eventually(lambda: in_flight("0"), DEADLINE_S, "none in flight again")
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watcher.wait(), QUIT_S) == 0
