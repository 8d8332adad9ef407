"""Durations in the config: every `*_s` key takes "5m" as Ollama's keep_alive does, read by the
one parser both use; a string that is no duration is refused naming the key and the form."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import aiohttp

from hal0d import config as configuration
from hal0d.ollama import request as ollama_request
from tests.harness.client import chat_body
from tests.harness.daemons import STARTUP_S, ServerFactory
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.stubs import stub_command

ROOT = Path(__file__).resolve().parents[1]


def check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config", str(path)],
                          capture_output=True, text=True, timeout=30, cwd=ROOT)


def on_demand_slot(tmp_path: Path, idle_unload: str) -> str:
    port = free_port()
    command = ", ".join(f'"{arg}"' for arg in stub_command(port, tmp_path / "stub.log"))
    return textwrap.dedent(f"""
        [[slots]]
        name = "ondemand"
        upstream = "http://127.0.0.1:{port}"
        models = ["chat"]
        command = [{command}]
        start = "on_demand"
        idle_unload_s = {idle_unload}
        load_timeout_s = "1m"
        queue_timeout_s = "30s"

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """)


async def test_an_idle_unload_written_as_a_duration_unloads_the_model_after_that_long(
        start_hal0d: ServerFactory, tmp_path: Path, http: aiohttp.ClientSession) -> None:
    loaded = configuration.parse(tomllib.loads(on_demand_slot(tmp_path, '"1s"')),
                                 base_dir=tmp_path)
    [slot] = loaded.slots
    assert (slot.idle_unload_s, slot.load_timeout_s, slot.queue_timeout_s) == (1.0, 60.0, 30.0)
    hal0d = await start_hal0d("http://unused", config=loaded)

    async with asyncio.timeout(STARTUP_S), http.post(
            hal0d.make_url("/v1/chat/completions"), json=chat_body("chat", stream=False)) as resp:
        assert resp.status == 200, await resp.text()

    async def state() -> str:
        async with http.get(hal0d.make_url("/api/slots")) as resp:
            [shown] = (await resp.json())["slots"]
        assert shown["state"] == "stopped", shown["state"]
        return str(shown["state"])

    await eventually(state, 10.0, "the slot unloaded one idle second after its request")


def test_a_string_that_is_no_duration_is_refused_naming_the_key_and_the_form(
        tmp_path: Path) -> None:
    path = tmp_path / "hal0d.toml"
    path.write_text('[dispatcher]\ndirect_read_timeout_s = "20m"\n'
                    + on_demand_slot(tmp_path, '"5 minutes"'))
    result = check_config(path)
    assert result.returncode == 1
    assert result.stderr.splitlines() == [
        "dispatcher.direct_read_timeout_s: '20m' (1200.0 s) is outside 30.0-600.0",
        "slots[0].idle_unload_s: '5 minutes' is not a duration (\"90s\", \"5m\", \"1h30m\") nor "
        'a number of seconds (slot "ondemand")',
    ], result.stderr
    path.write_text(on_demand_slot(tmp_path, '"5m"'))
    assert check_config(path).returncode == 0


def test_the_config_and_ollamas_keep_alive_read_durations_with_one_parser() -> None:
    assert ollama_request.go_duration is configuration.go_duration
    assert ollama_request.parse_keep_alive("10m") == configuration.go_duration("10m") == 600.0
