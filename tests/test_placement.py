"""Each load goes to the device where its footprint fits: on a simulated box of two 24 GiB GPUs
with a desktop holding 20 GiB of the first, a 10 GiB model is started on the second
(CUDA_VISIBLE_DEVICES=1, as the stub, like llama-server, reads it), where before it went to the
first and ran out of memory. The rule itself (devices/placement.py) is checked on its own too.
A real `hal0d serve`, real stub processes, the box read through its devices_command."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import aiohttp
import orjson

from hal0d.devices.placement import Margins, Placement, anywhere, capacity_mib, place
from hal0d.devices.reading import DeviceMemory, Reading
from hal0d_stub.device import make_box
from tests.harness.daemons import serving
from tests.harness.gpu_box import devices_command, mib_of, run_devices
from tests.harness.ports import free_port


def reading(*free: int, total: int = 24576) -> Reading:
    return Reading("nvml", tuple(DeviceMemory(index, "gpu", total, total - mib)
                                 for index, mib in enumerate(free)), read_at=1.0)


def test_a_load_goes_where_it_fits_its_last_device_first_then_the_most_free() -> None:
    margins = Margins(512)
    assert place(6000, reading(8000, 12000), margins).devices == (1,)  # the most free
    assert place(6000, reading(8000, 12000), margins, preferred=(0,)).devices == (0,)  # its last
    assert place(7600, reading(8000, 12000), margins, preferred=(0,)).devices == (1,)  # margin
    assert place(7600, reading(8000, 12000), Margins(512, {0: 0}), preferred=(0,)).devices == (
        0,)  # device 0's own margin
    pinned = place(6000, reading(8000, 12000), margins, allowed=(0,))  # a slot's `devices`
    assert pinned is not None and pinned.devices == (0,)
    assert place(6000, reading(8000, 12000), margins, allowed=(5,)) is None  # no such device
    assert place(1, Reading(None), margins) is None  # nothing read: nothing placed
    assert place(1, Reading("command", error="devices_command: timed out"), margins) is None


def test_a_model_no_one_device_holds_is_split_over_the_fewest_that_hold_it() -> None:
    margins = Margins(512)
    split = place(16000, reading(8000, 12000, 4000), margins)
    assert split is not None and split.devices == (0, 1)  # the two with the most room
    # In proportion to the 7488 and 11488 MiB each has to spare: 6313.7 and 9686.3.
    assert split.shares_mib == (6314, 9686)
    assert split.command(["srv", "-ts", "{tensor_split}", "-dev", "{gpus}"]) == [
        "srv", "-ts", "6314,9686", "-dev", "0,1"]
    assert "split" in split.why
    assert place(20000, reading(8000, 12000), margins) is None  # 19 GiB to spare in all
    nowhere = anywhere(20000, reading(8000, 12000), margins)
    assert nowhere is not None and nowhere.devices == (1,) and "the most free" in nowhere.why
    assert capacity_mib(reading(8000, 12000), margins) == 2 * (24576 - 512)
    assert capacity_mib(reading(8000, 12000), Margins(512, {1: 4096}), allowed=(1,)) == 20480
    assert capacity_mib(Reading(None), margins) is None


def test_the_command_is_told_its_device_by_placeholder_else_by_environment() -> None:
    on_one = Placement((1,), "nvml", "")
    assert on_one.command(["srv", "--device", "{gpu}", "-ts", "{tensor_split}"]) == [
        "srv", "--device", "1", "-ts", "1"]
    assert on_one.environment(["srv", "--device", "{gpu}"], {}) == {}  # it names its own
    assert on_one.environment(["srv"], {}) == {"CUDA_VISIBLE_DEVICES": "1",
                                               "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert on_one.environment(["srv"], {"CUDA_VISIBLE_DEVICES": "0"}) == {}  # pinned already
    assert Placement((0, 1), "amdsmi", "").environment(["srv"], {}) == {
        "HIP_VISIBLE_DEVICES": "0,1"}


async def test_a_model_is_started_on_the_gpu_where_it_fits(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    box = tmp_path / "box.json"
    make_box(box, [24576, 24576])
    status, _, err = await run_devices(box, "--take", "20000", "--device", "0", "--owner",
                                       "desktop")
    assert status == 0, err
    port, stub_port = free_port(), free_port()
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(stub_port),
               "--device-state", str(box), "--footprint-mib", "10000"]
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        [devices]
        devices_command = {orjson.dumps(devices_command(box)).decode()}
        read_interval_s = 60

        [[slots]]
        name = "qwen"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["chat"]
        start = "on_demand"
        memory_mib = 10000
        command = {orjson.dumps(command).decode()}

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """))
    body = {"model": "chat", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with serving(config, port) as hal0d:
        async with http.post(f"{hal0d.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
        placed = hal0d.named("slot.placed")
        assert [(line["slot"], line["devices"]) for line in placed] == [("qwen", [1])]
        started = hal0d.named("slot.process_started")[-1]
        assert started["env"] == {"CUDA_VISIBLE_DEVICES": "1", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        assert mib_of(box, started["pid"]) == {1: 10000}
        assert not hal0d.named("slot.load_out_of_memory")


def test_a_slots_devices_are_device_indexes_each_once() -> None:
    from hal0d.config import ConfigError, parse

    def slot(devices: object) -> dict[str, object]:
        return {"slots": [{"name": "a", "upstream": "http://127.0.0.1:1", "models": ["m"],
                           "command": ["srv"], "devices": devices}]}

    assert parse(slot([1, 0])).slots[0].devices == (1, 0)
    for bad in ([], [0, 0], [-1], ["0"], [True]):
        try:
            parse(slot(bad))
        except ConfigError as exc:
            assert exc.problems == ["slots[0].devices: must be a non-empty list of device "
                                    "indexes (0-1023), each once, as /api/devices numbers "
                                    "them (slot \"a\")"], exc.problems
        else:
            raise AssertionError(f"devices = {bad!r} was taken")
