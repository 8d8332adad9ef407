"""The simulated GPU box: the memory of a few pretend GPUs, shared by every process of a test or a
benchmark through one small JSON file, so memory placement can be tested on a machine without a
GPU.

    {"devices": [{"index": 0, "name": "sim-24G", "total_mib": 24576}, ...],
     "allocations": [{"pid": 123, "device": 0, "mib": 900, "owner": "stub"}, ...]}

Stubs allocate from it as they load (device_load.py) and release as they exit; a test or the
benchmark takes memory in the name of an owner that is no process ("desktop", pid 0) and gives it
back (devices.py, the command that also prints the box as hal0d's devices_command reads it).

Every change is a read-modify-write under an exclusive flock, so allocations made at the same
instant by several processes never put a device over its total: an allocation is all or nothing
across the devices it asks for. The lock is a file of its own beside the state (FILE.lock) and the
state is replaced whole (written beside it, then renamed), so a process killed in the middle of a
write leaves the previous state, never half a file.

An allocation whose process is gone is dropped at every read and write, as a GPU driver frees the
memory of a process that died: a stub killed with SIGKILL, which could release nothing itself,
frees its memory by the next look at the box. A zombie counts as gone (it holds no memory on a
real GPU either, and a test's subreaper may leave a killed child unreaped for a while). An
allocation with pid 0 belongs to an owner that is no process and stays until released by name.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

TWO_24G_GPUS = (24576, 24576)
STUB_OWNER = "stub"
NO_PROCESS = 0  # the pid of an allocation held in an owner's name (a desktop, a game)
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Device:
    index: int
    name: str
    total_mib: int


@dataclasses.dataclass(frozen=True)
class Allocation:
    pid: int
    device: int
    mib: int
    owner: str


@dataclasses.dataclass(frozen=True)
class Box:
    devices: tuple[Device, ...]
    allocations: tuple[Allocation, ...]

    def device(self, index: int) -> Device:
        for device in self.devices:
            if device.index == index:
                return device
        raise ValueError(f"the simulated box has no device {index} "
                         f"(it has {', '.join(str(d.index) for d in self.devices)})")

    def used_mib(self, index: int) -> int:
        return sum(a.mib for a in self.allocations if a.device == index)

    def free_mib(self, index: int) -> int:
        return self.device(index).total_mib - self.used_mib(index)


def device_name(total_mib: int) -> str:
    """"sim-24G" for 24576 MiB, "sim-8000M" where the total is no whole number of GiB."""
    return f"sim-{total_mib // 1024}G" if total_mib % 1024 == 0 else f"sim-{total_mib}M"


def make_box(path: Path, totals_mib: Sequence[int] = TWO_24G_GPUS) -> Box:
    """A new box of len(totals_mib) devices, indexed from 0, with nothing allocated; a box
    already at `path` is replaced."""
    if not totals_mib or any(total <= 0 for total in totals_mib):
        raise ValueError(f"a box needs one device or more, each of some MiB: {list(totals_mib)}")
    box = Box(tuple(Device(index, device_name(total), total)
                    for index, total in enumerate(totals_mib)), ())
    with _locked(path):
        _write(path, box)
    return box


def read_box(path: Path) -> Box:
    """The box as it is now, without the allocations of processes that are gone (which are
    dropped from the file too)."""
    return _change(path, lambda box: (box, box))


def allocate(path: Path, pid: int, mib_by_device: Mapping[int, int],
             owner: str = STUB_OWNER) -> dict[int, int] | None:
    """Allocates `mib_by_device` ({device index: MiB}) for `pid` (NO_PROCESS for an owner's
    memory) in one step: None once done, or, when a device lacks room, nothing allocated and
    {device index: MiB missing} for every device that lacks it."""
    if any(mib < 0 for mib in mib_by_device.values()):
        raise ValueError(f"an allocation cannot be negative: {dict(mib_by_device)}")

    def take(box: Box) -> tuple[Box, dict[int, int] | None]:
        shortfall = {index: mib - box.free_mib(index)
                     for index, mib in mib_by_device.items() if mib > box.free_mib(index)}
        if shortfall:
            return box, shortfall
        taken = tuple(Allocation(pid, index, mib, owner)
                      for index, mib in mib_by_device.items() if mib > 0)
        return dataclasses.replace(box, allocations=box.allocations + taken), None

    return _change(path, take)


def release(path: Path, *, pid: int | None = None, owner: str | None = None
            ) -> list[Allocation]:
    """Releases every allocation of `pid`, or of `owner` (whatever its pid), and returns them."""
    if (pid is None) == (owner is None):
        raise ValueError("release by pid or by owner, one of the two")

    def released(allocation: Allocation) -> bool:
        return allocation.pid == pid if pid is not None else allocation.owner == owner

    def give_back(box: Box) -> tuple[Box, list[Allocation]]:
        kept = tuple(a for a in box.allocations if not released(a))
        return (dataclasses.replace(box, allocations=kept),
                [a for a in box.allocations if released(a)])

    return _change(path, give_back)


def process_is_gone(pid: int) -> bool:
    """Whether `pid` no longer runs: no such process, or a zombie (it has exited; only its exit
    status waits to be collected). os.kill(pid, 0) alone says a zombie lives."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # someone else's process: it exists
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return not Path("/proc/self").exists()  # gone between the two looks; no /proc: it runs
    # The command name in parentheses may hold spaces and ')': the state follows the last ')'.
    return stat[stat.rindex(")") + 2:].startswith("Z")


# -- the file ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released as the file closes, or as its process dies
        yield


def _change(path: Path, change: Callable[[Box], tuple[Box, T]]) -> T:
    """Under the lock: `change` gets the box without the allocations of processes that are gone
    and returns the box to keep (written back if it differs from the file's) and its answer."""
    with _locked(path):
        try:
            stored = _from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            raise FileNotFoundError(f"no simulated box at {path}: make one first (make_box, or "
                                    f"python -m hal0d_stub.devices {path} --make 24576,24576)"
                                    ) from None
        living = dataclasses.replace(stored, allocations=tuple(
            a for a in stored.allocations if a.pid == NO_PROCESS or not process_is_gone(a.pid)))
        kept, answer = change(living)
        if kept != stored:
            _write(path, kept)
        return answer


def _write(path: Path, box: Box) -> None:
    """Written beside the state, then renamed over it: a reader sees the old box or the new one.
    Only the holder of the lock writes, so one name for the new file is enough."""
    new = path.with_name(path.name + ".new")
    new.write_text(json.dumps(dataclasses.asdict(box), indent=1) + "\n")
    os.replace(new, path)


def _from_json(raw: dict[str, Any]) -> Box:
    return Box(tuple(Device(**device) for device in raw["devices"]),
               tuple(Allocation(**allocation) for allocation in raw["allocations"]))
