"""The status page's hal0d on the simulated GPU box (gpu_box.py), as the Devices panel's test and
`make screenshot` start it: a box of devices, memory a desktop holds on them, and stub slots that
each load onto the one device their `devices = [N]` names (the stub takes its footprint there, as
llama-server takes its weights, and hal0d reads the box through its devices_command)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from hal0d_stub.device import make_box
from tests.harness.daemons import Hal0dPopen
from tests.harness.gpu_box import MODEL, devices_command
from tests.harness.page import page_daemon_text, serving_text
from tests.harness.ports import free_port

READ_INTERVAL_S = 1.0  # the box read every second: a load shows at the page's next read


@dataclass(frozen=True)
class BoxSlot:
    name: str
    model: str
    footprint_mib: int
    device: int


def make_gpu_box(path: Path, totals_mib: Iterable[int], desktop: Mapping[int, int]) -> None:
    """A new box of one device per total, with `desktop` ({device: MiB}) held by no process,
    taken as a test or an operator takes it: through the box's own command."""
    make_box(path, list(totals_mib))
    for device, mib in desktop.items():
        subprocess.run([*devices_command(path), "--take", str(mib), "--device", str(device),
                        "--owner", "desktop"], check=True, capture_output=True, timeout=30)


def slot_text(slot: BoxSlot, box: Path, tmp: Path, start: str) -> str:
    port = free_port()
    command = [sys.executable, "-m", "hal0d", "stub", "--port", str(port), "-m", MODEL,
               "--delay", "0.005", "--device-state", str(box),
               "--footprint-mib", str(slot.footprint_mib), "--log", str(tmp / f"{slot.name}.log")]
    return f"""
[[slots]]
name = "{slot.name}"
upstream = "http://127.0.0.1:{port}"
models = ["{slot.model}"]
command = {json.dumps(command)}
start = "{start}"
memory_mib = {slot.footprint_mib}
devices = [{slot.device}]
"""


def gpu_page_config_text(port: int, tmp: Path, box: Path, slots: Iterable[BoxSlot], *,
                         margin_mib: int = 512, start: str = "always") -> str:
    """hal0d reading `box`, with `slots` on it, each started `start` ("always", "on_demand")."""
    return page_daemon_text(port, tmp) + f"""
[devices]
devices_command = {json.dumps(list(devices_command(box)))}
read_interval_s = {READ_INTERVAL_S}
margin_mib = {margin_mib}
""" + "".join(slot_text(slot, box, tmp, start) for slot in slots)


@contextlib.contextmanager
def gpu_page_daemon(tmp: Path, box: Path, slots: Iterable[BoxSlot], *, margin_mib: int = 512,
                    start: str = "always") -> Iterator[Hal0dPopen]:
    """`hal0d serve` on gpu_page_config_text's config, stopped (and its slots with it) when the
    block ends."""
    with serving_text(tmp, lambda port: gpu_page_config_text(
            port, tmp, box, slots, margin_mib=margin_mib, start=start)) as daemon:
        yield daemon
