"""`Devices`: the one reader of the devices while hal0d runs, and the keeper of what it read.

It chooses the source: the [devices] devices_command when one is set, else NVML when it finds a
GPU, else amdsmi, else none (found once, at start: sources.find_library). With a source, one task
reads it every `read_interval_s` (each read whole before the next wait, so a slow command never
overlaps itself) and keeps the last `Reading`, each process in it told by the slot it belongs to
(owners.py), and per device its free memory over the last hour, one sample per read. With none,
no task runs: a box without a GPU and without a command pays for nothing but the one look at
start. A reload hands in its [devices] (`configure`): a command set or removed takes effect at
once, a new interval after the next read.

A failed read is kept as it is (its error, no devices: figures that could not be read are not
guessed) and logged once, `devices.read_failed reason=...`, until what fails changes; the next
good read is logged as `devices.read_ok`.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Final

from hal0d.config import DevicesConfig
from hal0d.devices.command import CommandSource
from hal0d.devices.owners import owner_of
from hal0d.devices.placement import Margins
from hal0d.devices.reading import NOTHING, DeviceMemory, ReadFailed, Reading
from hal0d.devices.sources import LibrarySource, Source, find_library
from hal0d.logs import get_logger

log = get_logger()

HOUR_S: Final = 3600.0
# One sample per read for an hour at the shortest read_interval_s (0.5 s).
MAX_SAMPLES: Final = 7200

# The slots' processes now: pid -> slot name (the lifecycle manager's slot_pids).
SlotPids = Callable[[], Mapping[int, str]]


class Devices:
    def __init__(self, config: DevicesConfig, slot_pids: SlotPids,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._slot_pids = slot_pids
        self._clock = clock
        self.last: Reading = NOTHING
        self._history: dict[int, collections.deque[tuple[float, int]]] = {}
        self._library: LibrarySource | None = None
        self._looked_for_library = False
        self._command: CommandSource | None = None
        self._task: asyncio.Task[None] | None = None
        self._told: tuple[str | None, str | None] = (None, None)  # (source, error) last logged

    # -- the source ----------------------------------------------------------------------------

    def source(self) -> Source | None:
        command = self.config.devices_command
        if command is None:
            return self._library
        if self._command is None or self._command.command != command:
            self._command = CommandSource(command)
        return self._command

    async def start(self) -> None:
        await self._settle()

    async def configure(self, config: DevicesConfig) -> None:
        """A reload's [devices]."""
        self.config = config
        await self._settle()

    async def _settle(self) -> None:
        """The read task runs exactly while there is a source to read."""
        if self.config.devices_command is None and not self._looked_for_library:
            self._looked_for_library = True
            self._library, why_not = await asyncio.to_thread(find_library)
            if self._library is None:
                log.info("devices.none", reason="; ".join(why_not),
                         hint="[devices] devices_command reads other devices")
        if self.source() is None:
            await self._stop_task()
            self.last, self._told = NOTHING, (None, None)
            self._history.clear()
        elif self._task is None:
            # A context of its own: the reload that started it is not what its lines are about.
            self._task = asyncio.create_task(self._run(), name="devices",
                                             context=contextvars.Context())

    async def stop(self) -> None:
        await self._stop_task()
        if self._library is not None:
            try:
                await self._library.close()
            except ReadFailed as exc:
                log.warning("devices.close_failed", reason=str(exc))
            self._library = None

    async def _stop_task(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            try:
                await self.read()
            except Exception:  # a bug: logged, and the next read is tried all the same
                log.exception("devices.read_bug")
            await asyncio.sleep(self.config.read_interval_s)

    # -- a read --------------------------------------------------------------------------------

    async def read(self) -> Reading:
        """Reads the source once; the Reading is kept as the last and returned."""
        source = self.source()
        if source is None:
            reading = NOTHING
        else:
            try:
                devices = await source.read()
                reading = Reading(source.name, self._owned(devices), None, self._clock())
            except ReadFailed as exc:
                reading = Reading(source.name, (), str(exc), self._clock())
        self._keep(reading)
        self._tell(reading)
        return reading

    def _owned(self, devices: tuple[DeviceMemory, ...]) -> tuple[DeviceMemory, ...]:
        leaders = self._slot_pids()
        return tuple(dataclasses.replace(device, processes=tuple(
            dataclasses.replace(process, slot=owner_of(process.pid, leaders))
            for process in device.processes)) for device in devices)

    def _keep(self, reading: Reading) -> None:
        if reading.source != self.last.source:
            self._history.clear()  # another source numbers other devices
        self.last = reading
        if reading.error is not None or reading.read_at is None:
            return  # a gap in the history: nothing was read
        now = reading.read_at
        present = {device.index for device in reading.devices}
        for index in [index for index in self._history if index not in present]:
            del self._history[index]
        for device in reading.devices:
            samples = self._history.setdefault(
                device.index, collections.deque(maxlen=MAX_SAMPLES))
            samples.append((now, device.free_mib))
            while samples and samples[0][0] < now - HOUR_S:
                samples.popleft()

    def _tell(self, reading: Reading) -> None:
        told = (reading.source, reading.error)
        if told == self._told:
            return
        self._told = told
        if reading.error is not None:
            log.warning("devices.read_failed", source=reading.source, reason=reading.error)
        elif reading.source is not None:
            log.info("devices.read_ok", source=reading.source, devices=len(reading.devices),
                     names=[device.name for device in reading.devices])

    def reads(self) -> bool:
        """Whether there is a source to read: loads are placed and room made on the devices."""
        return self.source() is not None

    def margins(self) -> Margins:
        """The room kept free on each device ([devices] margin_mib, margins_mib)."""
        return Margins(self.config.margin_mib, self.config.margins_mib)

    def history(self, index: int) -> list[tuple[float, int]]:
        """The device's free MiB over the last hour: (unix seconds, MiB), oldest first."""
        return list(self._history.get(index, ()))

