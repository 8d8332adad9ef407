"""What `check-config` says of the devices: the models that can never fit on them. The devices
are read once, as hal0d would read them (its devices_command, else NVML, else amdsmi), and each
slot's figure (its `memory_mib`, else a library model's estimate) is set against the most the
devices it may use could ever hold, each emptied to its margin. Such a model's loads are refused
at once while hal0d serves (lifecycle/device_room.py); check-config says so before.

A box without devices to read says nothing here: nothing is placed there.
"""

from __future__ import annotations

import asyncio
import contextlib

from hal0d.config import Config, SlotConfig
from hal0d.devices.command import CommandSource
from hal0d.devices.placement import Margins, capacity_mib
from hal0d.devices.reading import ReadFailed, Reading
from hal0d.devices.sources import Source, find_library


async def read_once(config: Config) -> Reading | None:
    """One read of the devices; None when there is nothing to read."""
    source: Source | None
    if config.devices.devices_command is not None:
        source = CommandSource(config.devices.devices_command)
    else:
        source, _ = await asyncio.to_thread(find_library)
    if source is None:
        return None
    try:
        return Reading(source.name, await source.read())
    except ReadFailed as exc:
        return Reading(source.name, error=str(exc))
    finally:
        with contextlib.suppress(ReadFailed):  # read or not, the look is over
            await source.close()


def figure_of(slot: SlotConfig) -> tuple[int, str] | None:
    """What a slot's model is taken to need, and what says so."""
    if slot.memory_mib:
        return slot.memory_mib, "memory_mib"
    if slot.library is not None and slot.library.estimate_mib:
        return slot.library.estimate_mib, "its estimate from the GGUF file"
    return None


def never_fits(config: Config, reading: Reading) -> list[tuple[int, str]]:
    """(slot index, problem) for each slot whose model is more than its devices could hold."""
    margins = Margins(config.devices.margin_mib, config.devices.margins_mib)
    found = []
    for index, slot in enumerate(config.slots):
        figure = figure_of(slot)
        capacity = capacity_mib(reading, margins, slot.devices)
        if figure is None or capacity is None or figure[0] <= capacity:
            continue
        devices = ", ".join(f"device {device.index}: {device.total_mib} MiB"
                            for device in reading.devices
                            if slot.devices is None or device.index in slot.devices)
        found.append((index, f"needs {figure[0]} MiB ({figure[1]}) and the devices it may use "
                             f"hold at most {capacity} MiB, each emptied to its margin "
                             f"({devices}): its loads are refused"))
    return found
