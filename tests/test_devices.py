"""Each GPU's memory and who holds it, read by a real `hal0d serve`: a devices_command (a small
script the test writes, printing what a file says, so the memory changes between reads) shows in
GET /api/devices with each device's hour of free memory and in /metrics; a slot's processes are
told by their slot; each bad output is one error line and hal0d keeps serving. NVML and amdsmi
are read through the same interface where this machine has their devices, and skipped with the
reason where it has not. The [devices] table is checked and round-trips through print-config.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from hal0d import config as configuration
from hal0d.config import DevicesConfig
from hal0d.devices.amd import open_amdsmi
from hal0d.devices.nvml import open_nvml
from hal0d.devices.reading import Unavailable
from hal0d.devices.sources import LibrarySource, find_library
from tests.harness.cli import hal0d_cli
from tests.harness.config import SLOT, config_text, write
from tests.harness.daemons import Hal0dProcess, serving
from tests.harness.observe import get_json, scrape, value
from tests.harness.poll import eventually
from tests.harness.ports import free_port
from tests.harness.processes import live_children
from tests.harness.stubs import stub_command

READ_EVERY_S = 0.5  # the shortest read_interval_s: the tests wait for a few reads
# The devices_command: prints what the plan file says, as often, after a sleep, with an exit code.
SCRIPT = """
import json, sys, time
with open(sys.argv[1]) as f:
    plan = json.load(f)
time.sleep(plan.get("sleep_s", 0))
sys.stderr.write(plan.get("stderr", ""))
sys.stdout.write(plan["stdout"] * plan.get("times", 1))
sys.stdout.flush()
sys.exit(plan.get("exit", 0))
"""
GIB = 1024


def toml_list(items: list[str] | tuple[str, ...]) -> str:
    return orjson.dumps(list(items)).decode()


class Box:
    """What the devices_command prints next: rewritten whole (a rename), never seen half
    written."""

    def __init__(self, folder: Path) -> None:
        self.script = folder / "devices.py"
        self.script.write_text(SCRIPT)
        self.plan = folder / "plan.json"

    @property
    def command(self) -> list[str]:
        return [sys.executable, str(self.script), str(self.plan)]

    def prints(self, stdout: str, **how: Any) -> None:
        written = self.plan.with_suffix(".new")
        written.write_bytes(orjson.dumps({"stdout": stdout, **how}))
        os.replace(written, self.plan)

    def holds(self, *devices: dict[str, Any]) -> None:
        self.prints(orjson.dumps({"devices": list(devices)}).decode())


def gpu(index: int, used: int, *processes: tuple[int, int], total: int = 24 * GIB,
        name: str = "Sim 24G") -> dict[str, Any]:
    return {"index": index, "name": name, "total_mib": total, "used_mib": used,
            "processes": [{"pid": pid, "used_mib": mib} for pid, mib in processes]}


def daemon_config(tmp_path: Path, box: Box, slot: str = "") -> tuple[Path, int]:
    port = free_port()
    devices = textwrap.dedent(f"""
        [devices]
        devices_command = {toml_list(box.command)}
        read_interval_s = {READ_EVERY_S}
        margin_mib = 1024
    """)
    path = tmp_path / "hal0d.toml"
    path.write_text(config_text("http://127.0.0.1:9", port, tmp_path, slot=slot, extra=devices))
    return path, port


async def devices_once(http: aiohttp.ClientSession, hal0d: Hal0dProcess,
                       check: Any, what: str, timeout: float = 10.0) -> dict[str, Any]:
    """GET /api/devices once `check(answer)` holds."""
    async def answered() -> dict[str, Any]:
        answer: dict[str, Any] = await get_json(http, hal0d, "/api/devices")
        assert check(answer), answer
        return answer

    return await eventually(answered, timeout, what)


async def test_a_devices_command_is_read_on_its_interval_with_each_devices_hour(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    box = Box(tmp_path)
    box.holds(gpu(0, 1200, (os.getpid(), 900)), gpu(1, 0, total=8 * GIB, name="Sim 8G"))
    config, port = daemon_config(tmp_path, box)
    async with serving(config, port) as hal0d:
        answer = await devices_once(
            http, hal0d, lambda a: len(a["devices"]) == 2 and
            len(a["devices"][0]["history"]) >= 3, "three reads of two devices")
        assert (answer["source"], answer["error"], answer["margin_mib"]) == ("command", None,
                                                                            1024)
        first, second = answer["devices"]
        assert first["name"] == "Sim 24G" and second["name"] == "Sim 8G"
        assert (first["total_mib"], first["used_mib"], first["free_mib"]) == (
            24 * GIB, 1200, 24 * GIB - 1200)
        assert first["processes"] == [{"pid": os.getpid(), "used_mib": 900, "slot": None}]
        assert first["other_mib"] == 1200 and first["gtt"] is None
        times = [at for at, _ in first["history"]]
        assert times == sorted(times) and times[-1] <= answer["read_at"] + 0.1
        assert {free for _, free in first["history"]} == {24 * GIB - 1200}

        # Memory another program took meanwhile is seen at the next read.
        box.holds(gpu(0, 5000), gpu(1, 0, total=8 * GIB, name="Sim 8G"))
        answer = await devices_once(
            http, hal0d, lambda a: a["devices"][0]["free_mib"] == 24 * GIB - 5000,
            "the new figures read")
        history = answer["devices"][0]["history"]
        assert [free for _, free in history][:2] == [24 * GIB - 1200] * 2
        assert history[-1][1] == 24 * GIB - 5000
        [found] = hal0d.named("devices.read_ok")  # logged once, not once per read
        assert found["source"] == "command" and found["devices"] == 2


async def test_a_slots_processes_are_told_by_the_slot_and_the_rest_is_other(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """The slot's command is a shell that starts the stub: the shell is the slot's process,
    the stub its child in its process group. Both are the slot's; the test process is not."""
    box = Box(tmp_path)
    box.holds(gpu(0, 0))
    stub_port = free_port()
    wrapped = ["/bin/sh", "-c", '"$@" & wait', "sh",
               *stub_command(stub_port, tmp_path / "stub.log")]
    config, port = daemon_config(tmp_path, box, slot=f"""
        [[slots]]
        name = "gpu"
        upstream = "http://127.0.0.1:{stub_port}"
        models = ["chat"]
        command = {toml_list(wrapped)}
        start = "on_demand"
    """)
    async with serving(config, port) as hal0d:
        async with http.post(f"{hal0d.url}/api/slots/gpu/load") as resp:
            assert resp.status == 200, await resp.text()
        [view] = (await get_json(http, hal0d, "/api/slots"))["slots"]
        leader = view["pid"]
        [server] = [pid for pid, line in live_children(leader).items() if "stub" in line]
        box.holds(gpu(0, 8000, (leader, 2000), (server, 3000), (os.getpid(), 900)))
        answer = await devices_once(http, hal0d, lambda a: a["devices"][0]["used_mib"] == 8000,
                                    "the slot's processes read")
        [device] = answer["devices"]
        assert {p["pid"]: p["slot"] for p in device["processes"]} == {
            leader: "gpu", server: "gpu", os.getpid(): None}
        assert device["other_mib"] == 8000 - 5000

        samples = await scrape(http, hal0d)
        [total] = samples["hal0d_device_memory_total_mib"]  # `name` is no keyword of value()
        assert (total.labels, total.value) == ({"device": "0", "name": "Sim 24G"}, 24 * GIB)
        assert value(samples, "hal0d_device_memory_used_mib", device="0") == 8000
        assert value(samples, "hal0d_device_memory_free_mib", device="0") == 24 * GIB - 8000
        assert value(samples, "hal0d_device_slot_memory_mib", device="0", slot="gpu") == 5000
        assert value(samples, "hal0d_device_other_memory_mib", device="0") == 3000


BAD_OUTPUTS = [
    ({"stdout": "nvidia-smi: command not found\n"},
     "devices_command: printed no JSON: 'nvidia-smi: command not found'"),
    ({"stdout": " \n"}, "devices_command: printed nothing"),
    ({"stdout": '{"gpus": []}'}, 'devices_command: printed no {"devices": [...]} object'),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": "24576", "used_mib": 1}]}'},
     'devices_command: devices[0].total_mib: "24576" is not a whole number'),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": 24576, "used_mib": 1.5}]}'},
     "devices_command: devices[0].used_mib: 1.5 is not a whole number"),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": 24576, "used_mib": -1}]}'},
     "devices_command: devices[0].used_mib: -1 is negative"),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": 8192, "used_mib": 9000}]}'},
     "devices_command: devices[0].used_mib: 9000 is more than its total_mib 8192"),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": 8, "used_mib": 1}, '
                '{"index": 0, "total_mib": 8, "used_mib": 1}]}'},
     "devices_command: devices[1].index: 0 is devices[0]'s too"),
    ({"stdout": '{"devices": [{"index": 0, "total_mib": 8, "used_mib": 1, '
                '"processes": [{"pid": 7, "used_mib": 1}, {"pid": 7, "used_mib": 1}]}]}'},
     "devices_command: devices[0].processes[1].pid: 7 is listed twice"),
    ({"stdout": "x", "times": (1 << 20) + 1},
     "devices_command: printed more than 1048576 bytes"),
    ({"stdout": "", "exit": 3, "stderr": "warming up\nno GPU here\n"},
     "devices_command: exited with code 3: no GPU here"),
    ({"stdout": "{}", "sleep_s": 30}, "devices_command: no answer within 5 s"),
]


async def test_each_bad_output_is_one_error_line_and_hal0d_keeps_serving(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    box = Box(tmp_path)
    box.holds(gpu(0, 100))
    config, port = daemon_config(tmp_path, box)
    async with serving(config, port) as hal0d:
        await devices_once(http, hal0d, lambda a: a["devices"], "a good read first")
        for plan, error in BAD_OUTPUTS:
            box.prints(**plan)
            failed = await devices_once(http, hal0d, lambda a, e=error: a["error"] == e,
                                        f"the error {error!r}")
            assert failed["source"] == "command" and failed["devices"] == []
            # Read again (and failed the same way): still one line for it in the log. (Not for
            # the timeout: each of its reads waits out the 5 s bound, and the rule is the same.)
            if "sleep_s" not in plan:
                await devices_once(http, hal0d,
                                   lambda a, f=failed: a["read_at"] > f["read_at"],
                                   "another read", timeout=12.0)
            told = [line for line in hal0d.named("devices.read_failed")
                    if line["reason"] == error]
            assert len(told) == 1, told
            async with http.get(f"{hal0d.url}/healthz") as resp:
                assert resp.status == 200
        box.holds(gpu(0, 100))
        await devices_once(http, hal0d, lambda a: a["error"] is None and a["devices"],
                           "a good read again", timeout=12.0)
        assert "Traceback" not in hal0d.log.read_text()
        assert len(hal0d.named("devices.read_ok")) == 2  # the first good read, and again


async def test_without_a_gpu_or_a_command_nothing_is_read_until_a_reload_names_one(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    library, why_not = find_library()
    if library is not None:
        await library.close()
        pytest.skip(f"this machine has a GPU {library.name} reads: the box without one is "
                    "not here")
    box = Box(tmp_path)
    box.holds(gpu(0, 100))
    port = free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(config_text("http://127.0.0.1:9", port, tmp_path))
    async with serving(config, port) as hal0d:
        answer = await get_json(http, hal0d, "/api/devices")
        assert answer == {"source": None, "error": None, "read_at": None, "margin_mib": 512,
                          "devices": []}
        [none] = hal0d.named("devices.none")
        assert none["reason"] == "; ".join(why_not)
        assert "hal0d_device_memory_total_mib" not in await scrape(http, hal0d)

        reloads = len(hal0d.named("config.reloaded"))
        config.write_text(config.read_text() + textwrap.dedent(f"""
            [devices]
            devices_command = {toml_list(box.command)}
            read_interval_s = {READ_EVERY_S}
        """))
        hal0d.send(signal.SIGHUP)
        await hal0d.wait_for_count("config.reloaded", reloads + 1)
        answer = await devices_once(http, hal0d, lambda a: a["source"] == "command" and
                                    a["devices"], "the command read after the reload")
        assert answer["devices"][0]["used_mib"] == 100


@pytest.mark.parametrize("open_library", [open_nvml, open_amdsmi], ids=["nvml", "amdsmi"])
async def test_a_library_reads_its_devices_through_the_one_interface(open_library: Any) -> None:
    """Runs where the library finds a device; skipped, saying why, everywhere else (a box
    without the NVIDIA driver, without ROCm's amdsmi)."""
    try:
        reader = open_library()
    except Unavailable as exc:
        pytest.skip(str(exc))
    source = LibrarySource(reader)
    try:
        first, again = await source.read(), await source.read()
    finally:
        await source.close()
    assert first and [d.index for d in first] == [d.index for d in again]
    for device in first:
        assert device.name and device.total_mib > 0
        assert 0 <= device.used_mib <= device.total_mib
        assert device.free_mib == device.total_mib - device.used_mib
        assert all(p.pid > 0 and 0 <= p.used_mib <= device.total_mib for p in device.processes)


# -- the [devices] table ---------------------------------------------------------------------


@pytest.mark.parametrize(("toml", "problem"), [
    ("[devices]\nmargin_mib = -1\n", "devices.margin_mib: -1 is outside 0-1048576"),
    ("[devices]\nread_interval_s = 0.1\n", "devices.read_interval_s: 0.1 is outside 0.5-3600.0"),
    ("[devices]\ndevices_command = []\n",
     "devices.devices_command: must be a non-empty list of non-empty strings"),
    ('[devices]\ndevices_command = "nvidia-smi"\n',
     "devices.devices_command: 'nvidia-smi' is not a list"),
    ("[devices]\ncommand = 1\n", "devices.command: unknown key"),
    ("[devices]\nmargins_mib = { gpu0 = 1024 }\n",
     "devices.margins_mib: must map device indexes, as /api/devices numbers them, to MiB"),
    ("[devices]\nmargins_mib = { 0 = -5 }\n", "devices.margins_mib: must map device indexes"),
])
def test_bad_devices_keys_are_named_by_their_path(tmp_path: Path, toml: str, problem: str
                                                  ) -> None:
    with pytest.raises(configuration.ConfigError) as caught:
        configuration.load(write(tmp_path, SLOT + toml))
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_the_devices_table_round_trips_through_print_config(tmp_path: Path) -> None:
    assert configuration.load(write(tmp_path, SLOT)).devices == DevicesConfig()
    result = hal0d_cli("print-config", "--config", str(write(tmp_path, SLOT)))
    assert tomllib.loads(result.stdout)["devices"] == {"margin_mib": 512, "margins_mib": {},
                                                       "read_interval_s": 5.0}
    path = write(tmp_path, SLOT + textwrap.dedent("""
        [devices]
        devices_command = ["hal0d-no-such-devices-program", "--json"]
        margin_mib = 0
        margins_mib = { 1 = 2048 }
        read_interval_s = "1m"
    """))
    result = hal0d_cli("print-config", "--config", str(path))
    assert result.returncode == 0, result.stderr
    assert tomllib.loads(result.stdout)["devices"] == {
        "devices_command": ["hal0d-no-such-devices-program", "--json"], "margin_mib": 0,
        "margins_mib": {"1": 2048}, "read_interval_s": 60.0}
    assert configuration.load(path).devices.margins_mib == {1: 2048}
    again = tmp_path / "printed.toml"
    again.write_text(result.stdout)
    assert configuration.load(again) == configuration.load(path)
    checked = hal0d_cli("check-config", "--config", str(path))
    assert checked.returncode == 0, checked.stderr
    assert ("devices.devices_command: program 'hal0d-no-such-devices-program' is not found"
            in checked.stderr), checked.stderr
