"""What one read of the devices says: each device's memory, in MiB, and the processes holding it.

Every source (NVML, amdsmi, a devices_command) gives the same shapes, so what reads them (the
API, the gauges, placement) never asks which one it was. A figure a source gives in bytes is
rounded toward less free memory: the total down, what is used up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

MIB: Final = 1 << 20


def mib_down(count: int) -> int:
    return count // MIB


def mib_up(count: int) -> int:
    return -(-count // MIB)


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """A process holding memory on a device; `slot`: the slot whose process it is (its own,
    one in its process group or one it started), None for any other program's."""

    pid: int
    used_mib: int
    slot: str | None = None


@dataclass(frozen=True, slots=True)
class Gtt:
    """An AMD GPU's GTT: system memory the GPU maps, which an APU's models mostly live in (its
    VRAM is a small carve-out)."""

    total_mib: int
    used_mib: int


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    index: int  # the source's own numbering (NVML's and amdsmi's: PCI bus order)
    name: str
    total_mib: int
    used_mib: int
    processes: tuple[ProcessMemory, ...] = ()
    gtt: Gtt | None = None

    @property
    def free_mib(self) -> int:
        return max(0, self.total_mib - self.used_mib)

    def held_by_slots(self) -> dict[str, int]:
        """The MiB each slot's processes hold here."""
        held: dict[str, int] = {}
        for process in self.processes:
            if process.slot is not None:
                held[process.slot] = held.get(process.slot, 0) + process.used_mib
        return held

    @property
    def other_mib(self) -> int:
        """What is in use here that no slot's process holds: other programs (a desktop, a
        game), the driver's own, processes the source cannot see."""
        return max(0, self.used_mib - sum(self.held_by_slots().values()))


@dataclass(frozen=True, slots=True)
class Reading:
    """One read: where from (`nvml`, `amdsmi`, `command`; None: nothing to read), the devices
    found, and when (unix seconds); `error`, one line, when the read failed (no devices then:
    figures that could not be read are not guessed)."""

    source: str | None
    devices: tuple[DeviceMemory, ...] = ()
    error: str | None = None
    read_at: float | None = None


NOTHING: Final = Reading(None)


class ReadFailed(Exception):
    """A source could not be read now; the message is the one line the Reading keeps."""


class Unavailable(Exception):
    """A library source (NVML, amdsmi) has no device to read on this machine: not an error (a
    box without a GPU). The message says why, for the log and a skipped test."""
