"""Where a load goes: the device where its footprint fits with its margin to spare (`[devices]
margin_mib`, or the device's own in `margins_mib`), read afresh as the load starts, preferring
the device its last process was on (a model measured there fits there again, and its saved
prompt cache was written by that process), then the one with the most free memory. A model that
fits on no one device alone is split over the fewest devices that hold it together, the most
free first, each given a share in proportion to what it has to spare (as llama.cpp splits by
default). The command is told the devices by the placeholders it names (`{gpu}`: "1", `{gpus}`:
"0,1", `{tensor_split}`: each device's share in MiB, "10240,8192"), else by the environment
hal0d starts it in: `CUDA_VISIBLE_DEVICES` (with `CUDA_DEVICE_ORDER=PCI_BUS_ID`, so CUDA numbers
the GPUs as NVML does), or `HIP_VISIBLE_DEVICES` for a device read through amdsmi; never when
hal0d's own environment already names the devices (a user who pinned them, or a unit's
drop-in, decided).

`place` says None of a load that fits nowhere: the lifecycle then makes room (device_room.py)
or, when none can be made, sends it to the device with the most free memory (`anywhere`) and
the server's own out-of-memory, retried once with room made, decides. Without devices to read
(no GPU, no devices_command) nothing is placed: today's behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from hal0d.devices.reading import DeviceMemory, Reading

GPU, GPUS, TENSOR_SPLIT = "{gpu}", "{gpus}", "{tensor_split}"
PLACEHOLDERS: Final = (GPU, GPUS, TENSOR_SPLIT)
# What hal0d's own environment may already say of the devices: then it places nothing itself.
VISIBLE: Final = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")


@dataclass(frozen=True, slots=True)
class Placement:
    devices: tuple[int, ...]
    source: str | None  # the reading's: "nvml", "amdsmi", "command"
    why: str
    shares_mib: tuple[int, ...] = ()  # what each of `devices` is to hold, in their order

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` with the devices' placeholders filled."""
        gpus = ",".join(str(index) for index in self.devices)
        split = ",".join(str(mib) for mib in self.shares_mib) or ",".join(
            "1" for _ in self.devices)
        return [arg.replace(GPUS, gpus).replace(GPU, str(self.devices[0]))
                .replace(TENSOR_SPLIT, split) for arg in argv]

    def environment(self, argv: Sequence[str],
                    environ: Mapping[str, str] = os.environ) -> dict[str, str]:
        """What the process's environment gets beside hal0d's: nothing when the command names
        its devices (a placeholder) or hal0d's environment already does."""
        if any(placeholder in arg for arg in argv for placeholder in PLACEHOLDERS) or any(
                name in environ for name in VISIBLE):
            return {}
        gpus = ",".join(str(index) for index in self.devices)
        if self.source == "amdsmi":
            return {"HIP_VISIBLE_DEVICES": gpus}
        return {"CUDA_VISIBLE_DEVICES": gpus, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


@dataclass(frozen=True, slots=True)
class Margins:
    """The room kept free on each device: `margin_mib`, or a device's own."""

    default_mib: int
    by_device: Mapping[int, int] = field(default_factory=dict)

    def of(self, index: int) -> int:
        return self.by_device.get(index, self.default_mib)


def usable(devices: Sequence[DeviceMemory], margins: Margins) -> list[tuple[DeviceMemory, int]]:
    """Each device with what a load may take of it now: its free memory less its margin."""
    return [(device, max(0, device.free_mib - margins.of(device.index))) for device in devices]


def candidates(reading: Reading, allowed: Sequence[int] | None) -> tuple[DeviceMemory, ...]:
    """The devices a load may go to (a slot's `devices`; None: any); none when the read
    failed."""
    if reading.error is not None:
        return ()
    return tuple(device for device in reading.devices
                 if allowed is None or device.index in allowed)


def place(need_mib: int, reading: Reading, margins: Margins, preferred: Sequence[int] = (),
          allowed: Sequence[int] | None = None) -> Placement | None:
    """Where a load needing `need_mib` fits among `allowed`: one device, else the fewest that
    hold it together; None when it fits nowhere (or there is nothing to place on)."""
    spare = usable(candidates(reading, allowed), margins)
    fits = [(device, room) for device, room in spare if room >= need_mib]
    if fits:
        was = [device for device, _ in fits if device.index in preferred]
        chosen = was[0] if was else max((device for device, _ in fits), key=_free)
        where = "where its last process was" if was else "the most free"
        return Placement((chosen.index,), reading.source,
                         f"device {chosen.index}: {need_mib} MiB fit with "
                         f"{margins.of(chosen.index)} MiB to spare, {where}", (need_mib,))
    return _split(need_mib, reading, spare)


def _split(need_mib: int, reading: Reading,
           spare: list[tuple[DeviceMemory, int]]) -> Placement | None:
    """The fewest devices, the most spare first, whose spare room holds `need_mib` together;
    each device's share in proportion to its spare room."""
    taken: list[tuple[DeviceMemory, int]] = []
    for device, room in sorted(spare, key=lambda pair: (-pair[1], pair[0].index)):
        if room <= 0:
            break
        taken.append((device, room))
        if len(taken) > 1 and sum(room for _, room in taken) >= need_mib:
            taken.sort(key=lambda pair: pair[0].index)
            shares = _shares(need_mib, [room for _, room in taken])
            names = ", ".join(f"{mib} MiB on device {device.index}"
                              for (device, _), mib in zip(taken, shares, strict=True))
            return Placement(tuple(device.index for device, _ in taken), reading.source,
                             f"devices {'+'.join(str(d.index) for d, _ in taken)}: "
                             f"{need_mib} MiB fit on no one device, split: {names}",
                             tuple(shares))
    return None


def _shares(need_mib: int, rooms: list[int]) -> list[int]:
    total = sum(rooms)
    shares = [need_mib * room // total for room in rooms]
    shares[0] += need_mib - sum(shares)
    return shares


def anywhere(need_mib: int, reading: Reading, margins: Margins,
             allowed: Sequence[int] | None = None) -> Placement | None:
    """A load that fits nowhere and for which no room can be made, sent to the device with the
    most free memory (its server's out-of-memory is then the word); None: nothing to place
    on."""
    devices = candidates(reading, allowed)
    if not devices:
        return None
    chosen = max(devices, key=_free)
    return Placement((chosen.index,), reading.source,
                     f"device {chosen.index}: {need_mib} MiB fit on no device with its margin "
                     f"(at most {chosen.free_mib} MiB free): the most free", (need_mib,))


def capacity_mib(reading: Reading, margins: Margins,
                 allowed: Sequence[int] | None = None) -> int | None:
    """The most a load could ever have on `allowed`, every device emptied but for its margin;
    None when nothing was read."""
    devices = candidates(reading, allowed)
    if not devices:
        return None
    return sum(max(0, device.total_mib - margins.of(device.index)) for device in devices)


def _free(device: DeviceMemory) -> tuple[int, int]:
    return device.free_mib, -device.index
