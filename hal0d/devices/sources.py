"""Where the devices are read from, behind one interface (`Source`): a devices_command
(command.py), or a library (NVML, amdsmi) whose blocking calls run in a thread (`LibrarySource`).

`find_library` tries NVML, then amdsmi, once: the first that finds a device is the source, and
why each found none is returned with it (a box without a GPU reads nothing and says why once).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from hal0d.devices.amd import open_amdsmi
from hal0d.devices.nvml import open_nvml
from hal0d.devices.reading import DeviceMemory, ReadFailed, Unavailable


class Source(Protocol):
    name: str

    async def read(self) -> tuple[DeviceMemory, ...]:
        """The devices now; ReadFailed with one line saying why not."""
        ...

    async def close(self) -> None: ...


class LibraryReader(Protocol):
    """A library's devices (nvml.NvmlReader, amd.AmdReader): blocking calls."""

    name: str

    def read(self) -> tuple[DeviceMemory, ...]: ...

    def close(self) -> None: ...


class LibrarySource:
    """A LibraryReader asked in a thread, its errors (a GPU fallen off the bus, a driver
    reloaded) one line each."""

    def __init__(self, reader: LibraryReader) -> None:
        self.reader = reader
        self.name = reader.name

    async def read(self) -> tuple[DeviceMemory, ...]:
        try:
            return await asyncio.to_thread(self.reader.read)
        except Exception as exc:
            raise ReadFailed(f"{self.name}: {type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        try:
            await asyncio.to_thread(self.reader.close)
        except Exception as exc:
            raise ReadFailed(f"{self.name}: shutting down: {exc}") from None


LIBRARIES: tuple[Callable[[], LibraryReader], ...] = (open_nvml, open_amdsmi)


def find_library() -> tuple[LibrarySource | None, list[str]]:
    """The first library that finds a device (blocking: run it in a thread), and why each one
    tried before it found none."""
    why_not: list[str] = []
    for open_library in LIBRARIES:
        try:
            return LibrarySource(open_library()), why_not
        except Unavailable as exc:
            why_not.append(str(exc))
    return None, why_not
