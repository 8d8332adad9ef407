"""Placement by measured memory, on the simulated box of two 24 GiB GPUs with six models of 3 to
30 GiB (the 30 needing both), three of them guessed wrong, and a desktop taking 2 GiB midway. No
groups: the models share the devices by what they measurably take. A real `hal0d serve`, real
stub processes loading onto the box (each takes its footprint, or fails with llama.cpp's own
out-of-memory lines), the box read through its devices_command.

What happens, load by load (margin 512 MiB):

    m20 (guessed 10 GiB, takes 20)  device 0; measured at 20 GiB
    m12                             device 1 (device 0 has 4 GiB left)
    m8  (guessed 4, takes 8)        device 1 (12 GiB left); measured
    the desktop takes 2 GiB of device 1
    m5  (guessed 2, takes 5)        device 0 by its guess, out of memory there; its footprint
                                    raised to the 5 GiB it asked, split over both on its retry
    m3                              nothing fits: the idle models cheapest to load again go
    m30                             nothing fits on one device: room made, split over both
    m20 while m30 streams           waits for m30's turn; m30's stream ends whole
    m60                             more than both devices hold: refused at once

Every answer is 200 but m60's; the box is sampled all along and no device is ever over its
total.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from hal0d_stub.device import make_box, read_box
from tests.harness.cli import hal0d_cli
from tests.harness.daemons import serving
from tests.harness.gpu_box import box_config, box_slot, run_devices
from tests.harness.poll import eventually
from tests.harness.ports import free_port

GIB = 1024
SIZES = {"m3": (3, 3), "m5": (5, 2), "m8": (8, 4), "m12": (12, 12), "m20": (20, 10),
         "m30": (30, 30)}  # name: (GiB it takes, GiB guessed in memory_mib)


async def ask(http: aiohttp.ClientSession, base: str, model: str,
              max_tokens: int = 4) -> tuple[int, dict[str, Any]]:
    body = {"model": model, "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def streamed(http: aiohttp.ClientSession, base: str, model: str,
                   max_tokens: int) -> list[bytes]:
    """A streamed answer's SSE data lines, to its end (the stub's "reasoning" model, asked
    "long", writes content until max_tokens)."""
    body = {"model": model, "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": "long"}]}
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return [line.strip() async for line in resp.content if line.startswith(b"data:")]


@contextlib.asynccontextmanager
async def sampled(state: Path) -> AsyncIterator[list[dict[int, tuple[int, int]]]]:
    """The box read every 20 ms while the block runs: per sample, {device: (used, total)}."""
    samples: list[dict[int, tuple[int, int]]] = []

    async def sample() -> None:
        while True:
            box = await asyncio.to_thread(read_box, state)
            samples.append({d.index: (box.used_mib(d.index), d.total_mib) for d in box.devices})
            await asyncio.sleep(0.02)

    task = asyncio.create_task(sample())
    try:
        yield samples
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def placed(hal0d: Any, slot: str) -> list[list[int]]:
    return [line["devices"] for line in hal0d.named("slot.placed") if line["slot"] == slot]


async def in_flight(http: aiohttp.ClientSession, base: str, slot: str) -> int:
    async with http.get(f"{base}/api/slots") as resp:
        views = {view["name"]: view for view in (await resp.json())["slots"]}
    count: int = views[slot]["in_flight"]
    return count


async def measured(http: aiohttp.ClientSession, base: str, slot: str) -> int | None:
    async with http.get(f"{base}/api/slots") as resp:
        views = {view["name"]: view for view in (await resp.json())["slots"]}
    mib: int | None = views[slot]["memory"]["measured_mib"]
    return mib


async def test_six_models_share_two_gpus_by_what_they_measurably_take(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    state = tmp_path / "box.json"
    make_box(state, [24 * GIB, 24 * GIB])
    port = free_port()
    # m30 answers "reasoning" too: the stub's long answer, for the stream it keeps busy.
    slots = [box_slot(name, (name, "reasoning") if name == "m30" else name, state, takes * GIB,
                      guess * GIB, "--delay", "0.05") for name, (takes, guess) in SIZES.items()]
    slots.append(box_slot("m60", "m60", state, 60 * GIB, 60 * GIB))
    config = tmp_path / "hal0d.toml"
    config.write_text(box_config(port, state, tmp_path, *slots))
    async with serving(config, port, within=60) as hal0d, sampled(state) as samples:
        base = hal0d.url
        status, answer = await ask(http, base, "m20")
        assert status == 200, answer
        assert placed(hal0d, "m20") == [[0]]
        # Learned after one load: the 20 GiB it took, not the 10 guessed.
        async def learned() -> bool:
            assert await measured(http, base, "m20") == 20 * GIB
            return True

        await eventually(learned, 10, "m20 measured at 20 GiB")
        for name, device in (("m12", 1), ("m8", 1)):
            assert (await ask(http, base, name))[0] == 200
            assert placed(hal0d, name) == [[device]]
        assert await run_devices(state, "--take", str(2 * GIB), "--device", "1",
                                 "--owner", "desktop") == (0, "", "")
        # m5's guess fits device 0, its truth does not: out of memory, then one retry with its
        # footprint raised to what it asked, split over the room both devices have left.
        status, answer = await ask(http, base, "m5")
        assert status == 200, answer
        retried = [line for line in hal0d.named("slot.load_retrying") if line["slot"] == "m5"]
        assert [line["need_mib"] for line in retried] == [5 * GIB]
        assert placed(hal0d, "m5") == [[0], [0, 1]]
        # Nothing fits m3: idle models are unloaded for it, none in flight.
        assert (await ask(http, base, "m3"))[0] == 200
        assert hal0d.named("slot.evicting"), "m3 found room without unloading anything"
        assert (await ask(http, base, "m30"))[0] == 200
        assert placed(hal0d, "m30")[-1] == [0, 1]
        # m30 streams (80 tokens 50 ms apart) while m20, for which it must go, is asked for:
        # m20 waits for m30's turn, and m30's stream ends whole.
        stream = asyncio.create_task(streamed(http, base, "reasoning", 80))
        await eventually(lambda: in_flight(http, base, "m30"), 10, "m30 streaming")
        status, _ = await ask(http, base, "m20")
        assert status == 200
        lines = await stream
        assert lines[-1] == b"data: [DONE]", lines[-3:]
        assert b'"finish_reason":"length"' in lines[-2] or b'"finish_reason": "length"' in (
            lines[-2]), lines[-3:]
        waited = [line for line in hal0d.named("slot.waiting_for_room") if line["slot"] == "m20"]
        assert waited and waited[0]["victims"] == ["m30"], waited
        assert not hal0d.named("slot.unload_forced")
        # The second m20 load was placed by its measure.
        assert "20480 MiB fit" in [line for line in hal0d.named("slot.placed")
                                   if line["slot"] == "m20"][-1]["why"]
        status, refused = await ask(http, base, "m60")
        assert status == 503
        assert refused["error"]["code"] == "slot.load_failed"
        assert refused["error"]["message"] == (
            "slot 'm60' could not load its model: m60 needs 61440 MiB and its devices hold at "
            "most 48128 MiB, each emptied to its margin (device 0: 24576 MiB, device 1: 24576 "
            "MiB)"), refused
        assert not [line for line in hal0d.named("slot.process_started")
                    if line["slot"] == "m60"]
    assert samples, "the box was never sampled"
    over = [sample for sample in samples if any(used > total for used, total in sample.values())]
    assert not over, over[:3]


def test_check_config_names_a_model_that_can_never_fit_on_the_devices(tmp_path: Path) -> None:
    """check-config reads the devices once, as hal0d would, and warns of each model larger than
    its devices could ever hold; a box whose devices cannot be read is said to be so."""
    state = tmp_path / "box.json"
    make_box(state, [24 * GIB, 24 * GIB])
    config = tmp_path / "hal0d.toml"
    config.write_text(box_config(
        free_port(), state, tmp_path, box_slot("m30", "m30", state, 30 * GIB, 30 * GIB),
        box_slot("m60", "m60", state, 60 * GIB, 60 * GIB),
        box_slot("pinned", "pinned", state, 30 * GIB, 30 * GIB, keys="devices = [1]\n")))
    checked = hal0d_cli("check-config", "--config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.splitlines() == [
        "warning: slots[1]: needs 61440 MiB (memory_mib) and the devices it may use hold at "
        "most 48128 MiB, each emptied to its margin (device 0: 24576 MiB, device 1: 24576 "
        "MiB): its loads are refused",
        "warning: slots[2]: needs 30720 MiB (memory_mib) and the devices it may use hold at "
        "most 24064 MiB, each emptied to its margin (device 1: 24576 MiB): its loads are "
        "refused"], checked.stderr
    state.unlink()  # the box gone: its command fails
    checked = hal0d_cli("check-config", "--config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert checked.stderr.startswith("warning: devices: cannot be read now (devices_command: "
                                     ), checked.stderr


async def test_a_model_goes_back_to_the_gpu_its_last_process_was_on(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """m12 is placed on device 1 while a desktop fills device 0; the desktop leaves, m12 is
    unloaded (its prompt cache saved) and asked for again: it goes back to device 1, where the
    process that saved its cache ran, though device 0 now has the more free memory, and its
    cache is restored there."""
    state = tmp_path / "box.json"
    make_box(state, [24 * GIB, 24 * GIB])
    assert (await run_devices(state, "--take", "20000", "--device", "0"))[0] == 0
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(box_config(port, state, tmp_path, box_slot(
        "m12", "m12", state, 12 * GIB, 12 * GIB, "--slot-save-path", "{prompt_cache_dir}",
        keys='prompt_cache = "save"\n')))
    async with serving(config, port) as hal0d:
        # Sharing the box, its requests may wait a turn there beyond the load's own bound.
        async with http.get(f"{hal0d.url}/api/slots") as resp:
            view = {v["name"]: v for v in (await resp.json())["slots"]}["m12"]
        assert view["turn_wait_s"] >= 600, view  # a load_timeout_s (600 s) at least
        assert (await ask(http, hal0d.url, "m12"))[0] == 200
        await eventually(lambda: measured(http, hal0d.url, "m12"), 10, "m12 measured")
        assert (await run_devices(state, "--release", "desktop"))[0] == 0
        async with http.post(f"{hal0d.url}/api/slots/m12/unload") as resp:
            assert resp.status == 200, await resp.text()
        assert (await ask(http, hal0d.url, "m12"))[0] == 200
        whys = [line["why"] for line in hal0d.named("slot.placed")]
        assert placed(hal0d, "m12") == [[1], [1]], whys
        saved = hal0d.named("slot.cache_saved")
        restored = hal0d.named("slot.cache_restored")
        assert saved and saved[0]["files"] >= 1, saved
        assert restored and restored[0]["files"] == saved[0]["files"], restored
        assert whys[1] == ("device 1: 12288 MiB fit with 512 MiB to spare, where its last "
                           "process was"), whys
