"""What a model takes on the devices is learned at its first load and replaces a wrong
`memory_mib` guess where its group counts memory: on a simulated 24 GiB GPU (the stub loads onto
it, the devices_command reads it), two models guessed at 15 GiB each do not fit a 22 GiB budget
together, but once the first is measured at its real 6 GiB, the second loads beside it instead
of unloading it. /api/slots shows the guess and the measure side by side. A real `hal0d serve`,
real stub processes."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from hal0d_stub.device import make_box
from tests.harness.daemons import serving
from tests.harness.gpu_box import devices_command
from tests.harness.ports import free_port


def slot(name: str, model: str, box: Path, footprint: int, guess: int) -> str:
    port = free_port()
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "--device-state",
               str(box), "--footprint-mib", str(footprint)]
    return textwrap.dedent(f"""
        [[slots]]
        name = "{name}"
        upstream = "http://127.0.0.1:{port}"
        models = ["{model}"]
        start = "on_demand"
        group = "gpu"
        memory_mib = {guess}
        command = {orjson.dumps(command).decode()}
    """)


async def ask(http: aiohttp.ClientSession, base: str, model: str) -> None:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def views(http: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with http.get(f"{base}/api/slots") as resp:
        return {view["name"]: view for view in (await resp.json())["slots"]}


async def test_a_measured_footprint_replaces_a_wrong_guess_after_one_load(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    box = tmp_path / "box.json"
    make_box(box, [24576])
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        [devices]
        devices_command = {orjson.dumps(devices_command(box)).decode()}
        read_interval_s = 60

        [groups.gpu]
        memory_mib = 22000
    """) + slot("a", "chat", box, 6000, 15000) + slot("b", "reasoning", box, 6000, 15000)
        + textwrap.dedent(f"""
        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """))
    async with serving(config, port) as hal0d:
        before = await views(http, hal0d.url)
        assert before["a"]["memory_mib"] == 15000
        assert before["a"]["memory"] == {"estimate_mib": None,
                                         "measured_mib": None, "by_device": None,
                                         "measured_at": None,
                                         "raised_by_out_of_memory": False}
        await ask(http, hal0d.url, "chat")
        measured = await hal0d.wait_for_event("slot.footprint_measured", timeout=10)
        assert (measured["slot"], measured["mib"], measured["configured_mib"]) == ("a", 6000, 15000)
        memory = (await views(http, hal0d.url))["a"]["memory"]
        assert (memory["measured_mib"], memory["by_device"]) == (6000, {"0": 6000})

        await ask(http, hal0d.url, "reasoning")  # 6000 learned + 15000 guessed: within 22000
        now = await views(http, hal0d.url)
        assert now["a"]["state"] == "ready" and now["b"]["state"] == "ready", now
        assert not hal0d.named("slot.unloaded"), hal0d.named("slot.unloaded")
        await hal0d.wait_for_count("slot.footprint_measured", 2, timeout=10)
        assert (await views(http, hal0d.url))["b"]["memory"]["measured_mib"] == 6000
