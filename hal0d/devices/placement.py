"""Where a load goes: the device where its footprint fits with `[devices] margin_mib` to spare,
read afresh as the load starts, preferring the device its last process was on (a model
measured there fits there again), then the one with the most free memory. The command is told
the device by the placeholders it names (`{gpu}`: "1", `{gpus}`: "1", `{tensor_split}`: "1"),
else by the environment hal0d starts it in: `CUDA_VISIBLE_DEVICES` (with `CUDA_DEVICE_ORDER=
PCI_BUS_ID`, so CUDA numbers the GPUs as NVML does), or `HIP_VISIBLE_DEVICES` for a device read
through amdsmi; never when hal0d's own environment already names the devices (a user who pinned
them, or a unit's drop-in, decided).

A load that fits nowhere still goes, to the device with the most free memory: the server then
says it ran out of memory, and the load is retried once with room made (load_jobs.py). Without
devices to read (no GPU, no devices_command) nothing is placed: today's behaviour.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
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

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` with the devices' placeholders filled."""
        gpus = ",".join(str(index) for index in self.devices)
        split = ",".join("1" for _ in self.devices)
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


def place(need_mib: int, reading: Reading, margin_mib: int, preferred: Sequence[int] = (),
          allowed: Sequence[int] | None = None) -> Placement | None:
    """The device for a load needing `need_mib`, among `allowed` (a slot's `devices`; None:
    any); None when there is none to place on."""
    devices = tuple(device for device in reading.devices
                    if allowed is None or device.index in allowed)
    if reading.error is not None or not devices:
        return None
    fits = [device for device in devices if device.free_mib - margin_mib >= need_mib]
    if fits:
        was = [device for device in fits if device.index in preferred]
        chosen = was[0] if was else max(fits, key=_free)
        why = (f"{need_mib} MiB fit with {margin_mib} MiB to spare, where its last process was"
               if was else f"{need_mib} MiB fit with {margin_mib} MiB to spare, the most free")
    else:
        chosen = max(devices, key=_free)
        why = (f"{need_mib} MiB fit on no device with {margin_mib} MiB to spare (at most "
               f"{chosen.free_mib} MiB free): the most free")
    return Placement((chosen.index,), reading.source, f"device {chosen.index}: {why}")


def _free(device: DeviceMemory) -> tuple[int, int]:
    return device.free_mib, -device.index

