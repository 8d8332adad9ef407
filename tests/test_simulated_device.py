"""The simulated GPU box that memory placement is tested on without a GPU: stub processes take
their footprint from it on the devices their CUDA_VISIBLE_DEVICES names, fail a load that does
not fit with llama-server's own out-of-memory lines, give their memory back as they exit (or have
it taken back once they are gone, as a driver does for a killed process), and the devices
command shows it all as hal0d's devices_command reads a machine's GPUs. Real processes
throughout; a stub's fate (serving, or exited) is waited for, never slept on."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import NamedTuple

import aiohttp
import pytest

from hal0d.cli import main
from hal0d_stub.device import TWO_24G_GPUS, make_box, read_box
from hal0d_stub.device_load import split_footprint, visible_devices
from tests.harness.gpu_box import (
    MODEL,
    BoxStubs,
    devices_json,
    mib_of,
    run_devices,
    stored_allocations,
    stubs_on,
)
from tests.harness.poll import eventually, eventually_sync
from tests.harness.ports import free_port
from tests.harness.processes import process_state


@pytest.fixture
def state(tmp_path: Path) -> Path:
    """A box of two 24 GiB GPUs, nothing allocated."""
    path = tmp_path / "box.json"
    make_box(path, TWO_24G_GPUS)
    return path


@pytest.fixture
async def stubs(state: Path) -> AsyncIterator[BoxStubs]:
    async with stubs_on(state) as started:
        yield started


async def test_stubs_take_their_footprint_on_the_devices_their_environment_names(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession
) -> None:
    on_0 = await stubs.start(4000, "0")
    on_1 = await stubs.start(6000, "1")
    for stub in (on_0, on_1):  # before the split one, whose shares follow the free memory
        assert await stub.fate(http) == "serving", stub.err_lines()
    on_both = await stubs.start(10000, "0,1")
    assert await on_both.fate(http) == "serving", on_both.err_lines()
    split_3_to_1 = await stubs.start(4000, "1,0", "--tensor-split", "3,1")
    assert await split_3_to_1.fate(http) == "serving", split_3_to_1.err_lines()
    assert mib_of(state, on_0.pid) == {0: 4000}
    assert mib_of(state, on_1.pid) == {1: 6000}
    # Without -ts, as llama.cpp: in proportion to each device's free memory (20576 and 18576).
    assert mib_of(state, on_both.pid) == {0: 5256, 1: 4744}
    assert mib_of(state, split_3_to_1.pid) == {1: 3000, 0: 1000}
    # Each names its devices as it numbers them, as llama.cpp does: the box's device 1 is CUDA0
    # to a process that sees only it, or sees it first.
    assert on_1.out_lines() == ["load_tensors:        CUDA0 model buffer size =  6000.00 MiB"]
    assert split_3_to_1.out_lines() == [
        "load_tensors:        CUDA0 model buffer size =  3000.00 MiB",
        "load_tensors:        CUDA1 model buffer size =  1000.00 MiB"]
    devices = (await devices_json(state))["devices"]
    assert [d["used_mib"] for d in devices] == [4000 + 5256 + 1000, 6000 + 4744 + 3000]
    assert {p["pid"] for p in devices[0]["processes"]} == {on_0.pid, on_both.pid,
                                                            split_3_to_1.pid}
    assert {p["pid"] for p in devices[1]["processes"]} == {on_1.pid, on_both.pid,
                                                            split_3_to_1.pid}


def out_of_memory(mib: str, device: int, size: int) -> list[str]:
    """llama-server's lines, written out here rather than taken from the stub's templates, so a
    change to those shows."""
    return [
        f"ggml_backend_cuda_buffer_type_alloc_buffer: allocating {mib} MiB on device {device}: "
        "cudaMalloc failed: out of memory",
        f"alloc_tensor_range: failed to allocate CUDA{device} buffer of size {size}",
        f"llama_model_load: error loading model: unable to allocate CUDA{device} buffer",
        "llama_model_load_from_file_impl: failed to load model",
        f"cmn  common_init_: failed to load model '{MODEL}'",
        f"srv    load_model: failed to load model, '{MODEL}'",
        "srv  llama_server: exiting due to model loading error",
    ]


class Crowded(NamedTuple):
    desktop_mib: int  # what a desktop holds on device 1 first
    footprint: int
    visible: str
    expected: list[str]
    args: tuple[str, ...] = ()


@pytest.mark.parametrize("case", [
    # Split evenly over both: device 0 has room for its 8000, device 1 (4576 free) does not.
    Crowded(20000, 16000, "0,1", out_of_memory("8000.00", 1, 8000 * 1024 * 1024),
            ("--tensor-split", "1,1")),
    # The box's device 1, which this process calls device 0.
    Crowded(0, 30000, "1", out_of_memory("30000.00", 0, 30000 * 1024 * 1024)),
], ids=["split-over-both", "device-1-seen-as-0"])
async def test_a_stub_that_does_not_fit_prints_llama_cpps_lines_exits_1_and_takes_nothing(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession, case: Crowded
) -> None:
    desktop_mib, footprint, visible, expected, args = case
    if desktop_mib:
        assert await run_devices(state, "--take", str(desktop_mib), "--device", "1") == (
            0, "", "")
    before = await devices_json(state)
    written = state.stat().st_mtime_ns  # every change to the box rewrites its file
    stub = await stubs.start(footprint, visible, *args)
    assert await stub.fate(http) == "exited 1"
    assert stub.err_lines() == expected
    assert stub.out_lines() == []
    # Not even for a moment: all or nothing, device 0's room included.
    assert state.stat().st_mtime_ns == written
    assert await devices_json(state) == before


@pytest.mark.parametrize("ending", [
    (signal.SIGTERM, "serving", 0),  # aiohttp's run_app stops gracefully on both
    (signal.SIGINT, "serving", 0),
    (signal.SIGTERM, "loading", 128 + signal.SIGTERM),
], ids=["sigterm-serving", "sigint-serving", "sigterm-loading"])
async def test_a_stub_gives_its_memory_back_as_it_exits(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession,
    ending: tuple[signal.Signals, str, int]
) -> None:
    sent, while_, status = ending
    if while_ == "serving":
        stub = await stubs.start(3000, "0")
        assert await stub.fate(http) == "serving", stub.err_lines()
    else:
        stub = await stubs.start(3000, "0", "--startup-delay", "60")

        def holds_its_footprint() -> bool:
            return mib_of(state, stub.pid) == {0: 3000}

        await eventually(holds_its_footprint, 20, "the loading stub holds its footprint")
    stub.process.send_signal(sent)
    assert await stub.exit_status() == status
    # Read past the box's reader, which would drop a dead process's memory itself: the stub
    # released it.
    assert stored_allocations(state) == []


async def test_a_killed_stubs_memory_is_released_at_the_next_read(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession
) -> None:
    stub = await stubs.start(3000, "1")
    assert await stub.fate(http) == "serving", stub.err_lines()
    stub.process.send_signal(signal.SIGKILL)
    await stub.exit_status()
    assert mib_of(state, stub.pid) == {1: 3000}  # it could release nothing itself
    devices = (await devices_json(state))["devices"]
    assert [(d["used_mib"], d["processes"]) for d in devices] == [(0, []), (0, [])]
    assert stored_allocations(state) == []  # dropped from the file by that read


def test_a_killed_stub_not_yet_reaped_holds_no_memory(state: Path) -> None:
    """A zombie has exited: its memory is free although its exit status is not collected yet
    (a test's subreaper or hal0d may collect it later)."""
    stub = subprocess.Popen(
        [sys.executable, "-m", "hal0d", "stub", "--port", str(free_port()),
         "--device-state", str(state), "--footprint-mib", "2000", "--startup-delay", "60"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def loaded() -> bool:
            return mib_of(state, stub.pid) == {0: 2000}  # no CUDA_VISIBLE_DEVICES: device 0

        def a_zombie() -> bool:
            found = process_state(stub.pid)
            return found is not None and found[0] == "Z"

        eventually_sync(loaded, 20, "the stub holds its footprint")
        stub.send_signal(signal.SIGKILL)
        eventually_sync(a_zombie, 10, "the killed stub is a zombie")
        assert read_box(state).allocations == ()
    finally:
        stub.kill()
        stub.wait()


async def test_a_desktop_takes_memory_and_gives_it_back_through_the_command(state: Path) -> None:
    assert await run_devices(state, "--take", "2048", "--device", "1", "--owner", "desktop") == (
        0, "", "")
    devices = (await devices_json(state))["devices"]
    assert devices[1]["used_mib"] == 2048
    assert devices[1]["processes"] == []  # a desktop's memory is no process hal0d could own
    status, out, err = await run_devices(state, "--take", "23000", "--device", "1",
                                         "--owner", "game")
    assert (status, out) == (1, "")
    assert err == "game cannot take 23000 MiB on device 1: 472 MiB short\n"
    assert await run_devices(state, "--release", "desktop") == (0, "", "")
    devices = (await devices_json(state))["devices"]
    assert [(d["used_mib"], d["processes"]) for d in devices] == [(0, []), (0, [])]


async def test_the_devices_command_prints_devices_commands_schema(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession
) -> None:
    stub = await stubs.start(3000, "0,1")
    assert await stub.fate(http) == "serving", stub.err_lines()
    for owner, mib in (("desktop", 2048), ("game", 1024)):
        assert await run_devices(state, "--take", str(mib), "--device", "1", "--owner",
                                 owner) == (0, "", "")
    assert await devices_json(state) == {"devices": [
        {"index": 0, "name": "sim-24G", "total_mib": 24576, "used_mib": 1500,
         "processes": [{"pid": stub.pid, "used_mib": 1500}]},
        {"index": 1, "name": "sim-24G", "total_mib": 24576, "used_mib": 1500 + 3072,
         "processes": [{"pid": stub.pid, "used_mib": 1500}]},  # the owners': in used_mib
    ]}


async def test_stubs_loading_at_once_never_put_a_device_over_its_total(
    state: Path, stubs: BoxStubs, http: aiohttp.ClientSession
) -> None:
    """Six stubs of 3000 MiB start together on one 10000 MiB device: three fit and serve, three
    fail their load, and no look at the file in between finds the device over its total."""
    make_box(state, [10000])
    most_used = 0
    sampling = True

    async def sample() -> None:
        nonlocal most_used
        while sampling:
            used = sum(a["mib"] for a in stored_allocations(state))
            most_used = max(most_used, used)
            await asyncio.sleep(0.005)

    sampler = asyncio.create_task(sample())
    try:
        started = [await stubs.start(3000, None) for _ in range(6)]
        fates = await asyncio.gather(*(stub.fate(http) for stub in started))
    finally:
        sampling = False
        await sampler
    assert sorted(fates) == ["exited 1"] * 3 + ["serving"] * 3, fates
    for stub, fate in zip(started, fates, strict=True):
        if fate == "serving":
            assert mib_of(state, stub.pid) == {0: 3000}
        else:
            assert stub.err_lines() == out_of_memory("3000.00", 0, 3000 * 1024 * 1024)
    assert (await devices_json(state))["devices"][0]["used_mib"] == 9000
    assert most_used <= 10000


@pytest.mark.parametrize(("environ", "seen"), [
    ({}, ("CUDA", [0])),  # neither variable: device 0, where llama-server would see every GPU
    ({"CUDA_VISIBLE_DEVICES": "1"}, ("CUDA", [1])),
    ({"CUDA_VISIBLE_DEVICES": "1,0"}, ("CUDA", [1, 0])),
    ({"CUDA_VISIBLE_DEVICES": "0,7,1"}, ("CUDA", [0])),  # CUDA stops at an invalid entry
    ({"CUDA_VISIBLE_DEVICES": ""}, ("CUDA", [])),  # no GPU: the model loads on the CPU
    ({"CUDA_VISIBLE_DEVICES": "-1"}, ("CUDA", [])),
    ({"HIP_VISIBLE_DEVICES": "1"}, ("ROCm", [1])),
    ({"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": "1"}, ("CUDA", [0])),
])
def test_the_devices_a_stub_sees_follow_its_environment(
    state: Path, environ: dict[str, str], seen: tuple[str, list[int]]
) -> None:
    assert visible_devices(environ, read_box(state)) == seen


@pytest.mark.parametrize(("footprint", "devices", "split", "shares"), [
    (10000, [0, 1], (), {0: 5000, 1: 5000}),
    (1001, [0, 1], (), {0: 501, 1: 500}),  # what rounding leaves goes to the first
    (4000, [1, 0], (3.0, 1.0), {1: 3000, 0: 1000}),  # proportions in the order seen
    (4000, [0, 1], (0.0, 1.0), {1: 4000}),  # a device with no share takes nothing
    (4000, [0, 1, 2], (1.0,), {0: 4000}),  # a device past the split's end gets 0, as -ts
])
def test_a_footprint_is_split_evenly_or_by_the_tensor_split(
    footprint: int, devices: list[int], split: tuple[float, ...], shares: dict[int, int]
) -> None:
    assert split_footprint(footprint, devices, split) == shares


@pytest.mark.parametrize("argv", [
    ["stub", "--footprint-mib", "100"],
    ["stub", "--device-state", "box.json"],
    ["stub", "--tensor-split", "1,1"],
])
def test_the_stubs_device_options_go_together(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert "hal0d stub: --" in capsys.readouterr().err


TAKER = """
import os, sys, time
from pathlib import Path
from hal0d_stub.device import NO_PROCESS, allocate
state, go, owner = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
while not go.exists():
    time.sleep(0.001)
print(sum(allocate(state, NO_PROCESS, {0: 1}, owner) is None for _ in range(40)))
"""


async def test_allocations_from_many_processes_at_once_are_never_lost_nor_over_the_total(
    state: Path
) -> None:
    """Six processes each try to take 1 MiB forty times, all at once, from a 100 MiB device:
    exactly 100 succeed and the box holds exactly those (a lost update would show as more
    successes than the box holds, a missed check as more than its total)."""
    make_box(state, [100])
    go = state.with_name("go")
    takers = [await asyncio.create_subprocess_exec(
        sys.executable, "-c", TAKER, str(state), str(go), f"taker-{n}",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE) for n in range(6)]
    go.touch()
    taken = []
    for taker in takers:
        out, err = await taker.communicate()
        assert taker.returncode == 0, err.decode()
        taken.append(int(out))
    assert sum(taken) == 100, taken
    assert read_box(state).used_mib(0) == 100
    assert {a.owner for a in read_box(state).allocations} == {
        f"taker-{n}" for n, count in enumerate(taken) if count}
