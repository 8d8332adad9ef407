"""What each model takes on the devices, learned: after each load that answered, the devices are
read and what the slot's processes hold on each is its footprint, kept per slot and command
(a context or a `--parallel` changed is another command: another footprint); a load that ran
out of memory raises it to what it asked (`raise_to`) until a load is measured. The one writer
of the footprints; the lifecycle reads them (`learned_mib`) where a group counts memory,
so a `memory_mib` guessed wrong is replaced by what the model really took after one load, and
/api/slots shows the guess (or a library model's estimate) and the measure side by side.

Nothing is learned without devices to read (no GPU and no devices_command), nor from a read
that failed or that shows nothing of the slot's processes (a server that keeps its weights on
the CPU): the configured figure stands then.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from hal0d.config import SlotConfig
from hal0d.devices.reading import Reading
from hal0d.lifecycle.observers import LifecycleObserver
from hal0d.lifecycle.vocabulary import LoadPhase
from hal0d.logs import get_logger

log = get_logger()

# A slot's footprint is learned per command: the same model with another context is another.
Key = tuple[str, tuple[str, ...]]


@dataclass(frozen=True, slots=True)
class Footprint:
    by_device: dict[int, int]  # device index -> MiB its processes held once it answered
    measured_at: float  # unix seconds
    raised: bool = False  # not measured: what an out-of-memory load asked (raise_to)

    @property
    def total_mib(self) -> int:
        return sum(self.by_device.values())


class Footprints(LifecycleObserver):
    """The lifecycle manager's: handed each slot's config by name (the manager's, as it is
    now), and, where hal0d reads devices, how to read them afresh (`attach`: Devices.read)."""

    def __init__(self, config_of: Callable[[str], SlotConfig | None]) -> None:
        self._read: Callable[[], Awaitable[Reading]] | None = None
        self._config_of = config_of
        self._learned: dict[Key, Footprint] = {}
        self._measuring: set[asyncio.Task[None]] = set()

    def attach(self, read: Callable[[], Awaitable[Reading]]) -> None:
        self._read = read

    def raise_to(self, config: SlotConfig, mib: int, device: int | None) -> int:
        """A load that ran out of memory asked for `mib` on `device`: its footprint is at least
        that from now on (until a load that answers is measured); returns the footprint."""
        learned = self._learned.get(_key(config))
        known = max(learned.total_mib if learned else 0, config.memory_mib or 0)
        raised = max(known, mib)
        self._learned[_key(config)] = Footprint({device or 0: raised}, time.time(), raised=True)
        if raised > known:
            log.info("slot.footprint_raised", slot=config.name, mib=raised, was_mib=known or None)
        return raised

    def devices_of(self, config: SlotConfig) -> tuple[int, ...]:
        """The devices its last measured load was on (where it fits again)."""
        learned = self._learned.get(_key(config))
        return tuple(learned.by_device) if learned is not None and not learned.raised else ()

    def learned_mib(self, config: SlotConfig) -> int | None:
        """What the slot's model took at its last load with this command; None: not measured."""
        learned = self._learned.get(_key(config))
        return learned.total_mib if learned is not None else None

    def view(self, config: SlotConfig) -> dict[str, object]:
        """The estimate and the measure, as /api/slots shows them under `memory` (beside the
        slot's `memory_mib`, the figure configured)."""
        learned = self._learned.get(_key(config))
        return {
            "estimate_mib": config.library.estimate_mib if config.library else None,
            "measured_mib": learned.total_mib if learned else None,
            "by_device": {str(index): mib for index, mib in learned.by_device.items()}
            if learned else None,
            "measured_at": learned.measured_at if learned else None,
            "raised_by_out_of_memory": learned.raised if learned else False,
        }

    async def close(self) -> None:
        for task in list(self._measuring):
            task.cancel()
        await asyncio.gather(*self._measuring, return_exceptions=True)

    # LifecycleObserver (lifecycle/manager.py)
    def load_phase(self, slot: str, phase: LoadPhase, elapsed_s: float,
                   reason: str | None) -> None:
        if phase is LoadPhase.READY and self._read is not None:
            task = asyncio.get_running_loop().create_task(self._measure(slot))
            self._measuring.add(task)
            task.add_done_callback(self._measuring.discard)

    async def _measure(self, slot: str) -> None:
        assert self._read is not None, "measured only where devices are read"
        reading = await self._read()
        config = self._config_of(slot)
        if config is None or reading.error is not None:
            return
        held = {device.index: mib for device in reading.devices
                if (mib := device.held_by_slots().get(slot))}
        if not held:
            return
        footprint = Footprint(held, reading.read_at or time.time())
        before = self._learned.get(_key(config))
        self._learned[_key(config)] = footprint
        log.info("slot.footprint_measured", slot=slot, mib=footprint.total_mib,
                 devices={str(index): mib for index, mib in held.items()},
                 configured_mib=config.memory_mib,
                 was_mib=before.total_mib if before else None)


def _key(config: SlotConfig) -> Key:
    return config.name, config.command or ()
