"""The simulated GPU box (hal0d_stub/device.py) in tests: stub processes that load onto it as
llama-server loads onto GPUs, and the devices command hal0d reads the box through.

A stub on the box is a real `hal0d stub --device-state FILE --footprint-mib N` process, its
devices chosen by CUDA_VISIBLE_DEVICES in its environment, its stdout and stderr in files beside
the box. Its fate is waited for, not slept on: it serves (its port answers) or it exits (an
out-of-memory load exits 1 before it listens)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from tests.harness.poll import eventually
from tests.harness.ports import free_port

STARTUP_S = 30.0  # a Python process importing aiohttp, with five others, on a busy two-core box
MODEL = "/models/sim-model.gguf"  # the -m each stub is given, which its failure lines name


def devices_command(state: Path) -> tuple[str, ...]:
    """The box as hal0d's [devices] devices_command runs it."""
    return (sys.executable, "-m", "hal0d_stub.devices", str(state))


async def run_devices(state: Path, *verb: str) -> tuple[int, str, str]:
    """`python -m hal0d_stub.devices FILE VERB...`: its exit status, stdout and stderr."""
    process = await asyncio.create_subprocess_exec(
        *devices_command(state), *verb, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await process.communicate()
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


async def devices_json(state: Path) -> dict[str, Any]:
    """What the devices command prints, parsed; the command must succeed."""
    status, out, err = await run_devices(state)
    assert status == 0, err
    parsed: dict[str, Any] = json.loads(out)
    return parsed


def stored_allocations(state: Path) -> list[dict[str, Any]]:
    """The allocations as the file holds them, read past the box's own reader: what a process
    released itself is gone from here, what the box drops for a dead process is not yet."""
    allocations: list[dict[str, Any]] = json.loads(state.read_text())["allocations"]
    return allocations


def mib_of(state: Path, pid: int) -> dict[int, int]:
    """{device: MiB} the file holds for `pid`."""
    held: dict[int, int] = {}
    for allocation in stored_allocations(state):
        if allocation["pid"] == pid:
            held[allocation["device"]] = held.get(allocation["device"], 0) + allocation["mib"]
    return held


@dataclasses.dataclass
class BoxStub:
    process: asyncio.subprocess.Process
    port: int
    stdout: Path
    stderr: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def out_lines(self) -> list[str]:
        return self.stdout.read_text().splitlines()

    def err_lines(self) -> list[str]:
        return self.stderr.read_text().splitlines()

    async def fate(self, http: aiohttp.ClientSession, timeout: float = STARTUP_S) -> str:
        """"serving" once its port answers, or "exited N" once it has exited with status N."""

        async def settled() -> str:  # "" while neither
            if self.process.returncode is not None:
                return f"exited {self.process.returncode}"
            with contextlib.suppress(aiohttp.ClientError):
                async with http.get(f"http://127.0.0.1:{self.port}/v1/models") as resp:
                    return "serving" if resp.status == 200 else ""
            return ""

        return await eventually(settled, timeout, f"stub {self.pid} serves or exits")

    async def exit_status(self, timeout: float = STARTUP_S) -> int:
        async with asyncio.timeout(timeout):
            return await self.process.wait()


class BoxStubs:
    """Starts stubs on a box and kills, at the end of the block, those still running."""

    def __init__(self, state: Path) -> None:
        self.state = state
        self.started: list[BoxStub] = []

    async def start(self, footprint_mib: int, visible: str | None, *extra: str) -> BoxStub:
        """A stub taking `footprint_mib` on the devices `visible` names as CUDA_VISIBLE_DEVICES
        (None: the variable unset); `extra`: more `hal0d stub` options."""
        port = free_port()
        env = {k: v for k, v in os.environ.items()
               if k not in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")}
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        stdout = self.state.with_name(f"stub-{port}.out")
        stderr = self.state.with_name(f"stub-{port}.err")
        with stdout.open("wb") as out, stderr.open("wb") as err:
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "hal0d", "stub", "--port", str(port), "-m", MODEL,
                "--device-state", str(self.state), "--footprint-mib", str(footprint_mib),
                *extra, env=env, stdout=out, stderr=err, stdin=asyncio.subprocess.DEVNULL)
        stub = BoxStub(process, port, stdout, stderr)
        self.started.append(stub)
        return stub

    async def kill_all(self) -> None:
        for stub in self.started:
            if stub.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    stub.process.send_signal(signal.SIGKILL)
                await stub.process.wait()


@contextlib.asynccontextmanager
async def stubs_on(state: Path) -> AsyncIterator[BoxStubs]:
    stubs = BoxStubs(state)
    try:
        yield stubs
    finally:
        await stubs.kill_all()


def box_slot(name: str, models: str | tuple[str, ...], state: Path, footprint_mib: int,
             guess_mib: int | None, *extra: str, keys: str = "") -> str:
    """A `[[slots]]` table of an on-demand stub serving `models` that takes `footprint_mib` on
    the box, guessed at `guess_mib` (memory_mib; None: not written); `extra`: more `hal0d stub`
    options, `keys`: more TOML lines of the slot."""
    port = free_port()
    names = (models,) if isinstance(models, str) else models
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "-m", MODEL,
               "--alias", ",".join(names), "--device-state", str(state), "--footprint-mib",
               str(footprint_mib), *extra]
    guess = f"memory_mib = {guess_mib}\n" if guess_mib is not None else ""
    return (f'\n[[slots]]\nname = "{name}"\nupstream = "http://127.0.0.1:{port}"\n'
            f'models = {json.dumps(list(names))}\nstart = "on_demand"\n{guess}'
            f"command = {json.dumps(command)}\n{keys}\n")


def box_config(port: int, state: Path, folder: Path, *slots: str, devices: str = "") -> str:
    """A hal0d config on the box: the devices read through its command (and `devices`, more
    lines of [devices]), `slots`, the history in `folder`, the log as JSON lines."""
    return (f"[server]\nport = {port}\n\n[devices]\n"
            f"devices_command = {json.dumps(list(devices_command(state)))}\n"
            f"read_interval_s = 60\n{devices}\n" + "".join(slots)
            + f'\n[metrics]\ndatabase = "{folder / "history.sqlite3"}"\n\n'
            '[logging]\nformat = "json"\n')
