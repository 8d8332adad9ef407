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

from tests.harness.cli import CLI_DEADLINE_S, QUIT_S, ROOT, cli, cli_daemon, env_without, row_of
from tests.harness.config import CLI_KEY, daemon_toml
from tests.harness.daemons import Hal0dProcess
from tests.harness.poll import eventually
from tests.harness.ports import free_port

CLEAR = "\x1b[H\x1b[2J"
AUTH = {"Authorization": f"Bearer {CLI_KEY}"}


@contextlib.asynccontextmanager
async def watching(daemon: Hal0dProcess) -> AsyncIterator[asyncio.subprocess.Process]:
    env = {**env_without("HAL0D_API_KEY"), "HAL0D_API_KEY": CLI_KEY}
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
async def daemon(tmp_path: Path) -> AsyncIterator[Hal0dProcess]:
    """test_cli_client's daemon, its on-demand slot `a` also serving the stub's `chatty`."""
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(daemon_toml(tmp_path, port).replace('models = ["chat"]',
                                                          'models = ["chat", "chatty"]'))
    async with cli_daemon(config, port) as served:
        yield served


async def test_status_watch_shows_a_second_request_in_flight_without_a_state_change(
    daemon: Hal0dProcess, http: aiohttp.ClientSession
) -> None:
    code, _, err = await cli("load", "a", "--config", str(daemon.config))
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

        await eventually(lambda: in_flight("0"), CLI_DEADLINE_S, "the first screen")
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
                await eventually(lambda c=count: in_flight(c), CLI_DEADLINE_S,  # type: ignore[misc]
                                 f"{count} in flight on the screen")
            async with http.get(f"{daemon.url}/api/slots", headers=AUTH) as slots:
                assert (await slots.json())["slots"][0]["in_flight"] == 2
        finally:
            for resp in streams:
                resp.close()
        await eventually(lambda: in_flight("0"), CLI_DEADLINE_S, "none in flight again")
        watcher.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(watcher.wait(), QUIT_S) == 0
