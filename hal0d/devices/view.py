"""What GET /api/devices shows: the last reading, each device with its processes (and the slot
each belongs to), what no slot holds, and its free memory over the last hour."""

from __future__ import annotations

from typing import Any

from hal0d.devices.reading import DeviceMemory
from hal0d.devices.watch import Devices


def devices_view(devices: Devices) -> dict[str, Any]:
    reading = devices.last
    return {
        "source": reading.source,
        "error": reading.error,
        "read_at": reading.read_at,
        "margin_mib": devices.config.margin_mib,
        "devices": [device_view(device, devices.history(device.index))
                    for device in reading.devices],
    }


def device_view(device: DeviceMemory, history: list[tuple[float, int]]) -> dict[str, Any]:
    return {
        "index": device.index,
        "name": device.name,
        "total_mib": device.total_mib,
        "used_mib": device.used_mib,
        "free_mib": device.free_mib,
        "other_mib": device.other_mib,
        "gtt": None if device.gtt is None else {"total_mib": device.gtt.total_mib,
                                                 "used_mib": device.gtt.used_mib},
        "processes": [{"pid": process.pid, "used_mib": process.used_mib, "slot": process.slot}
                      for process in device.processes],
        "history": [[round(at, 1), free] for at, free in history],
    }
