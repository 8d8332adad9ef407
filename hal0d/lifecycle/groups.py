"""Groups: slots that share one device, and the room a load needs on it.

The loads of a group take turns (one lock, FIFO), so two models never load onto one device at
once. While the group's limits would be exceeded (`max_loaded`, the `memory_mib` budget, or less
free memory than the slot needs by `free_memory_command`), the least recently used loaded
on-demand slot of the group is unloaded, idle ones first. `start = "always"` slots count against
the limits and are never evicted.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from hal0d.config import GroupConfig, SlotConfig
from hal0d.lifecycle.process import resolve_program
from hal0d.lifecycle.slots import Slot, SlotState
from hal0d.logs import get_logger

log = get_logger()

FREE_MEMORY_TIMEOUT_S: Final = 10.0
# The states in which a slot's process is alive (or being started): it occupies its device.
LOADED: Final = frozenset({
    SlotState.STARTING, SlotState.READY, SlotState.SERVING, SlotState.ERROR, SlotState.STOPPING,
})
# The states a victim may be unloaded from.
EVICTABLE: Final = frozenset({SlotState.READY, SlotState.SERVING, SlotState.ERROR})


class NoRoom(Exception):
    """The group cannot make room for a load: the cause is the load's failure."""


@dataclass(eq=False)
class Group:
    config: GroupConfig
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


@dataclass(frozen=True, slots=True)
class Member:
    """What room making needs to know of a slot of the group."""

    slot: Slot
    memory_mib: int
    evictable: bool  # on demand: may be unloaded to make room
    last_used: float


async def free_memory_mib(group: GroupConfig) -> int | None:
    """What the group's free_memory_command reports (the first number it prints), or None when
    it cannot be run or read (logged; the load then goes by the static limits alone)."""
    assert group.free_memory_command is not None
    argv = resolve_program(group.free_memory_command)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        log.warning("group.free_memory_failed", group=group.name, error=str(exc))
        return None
    try:
        async with asyncio.timeout(FREE_MEMORY_TIMEOUT_S):
            out, err = await process.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
        log.warning("group.free_memory_failed", group=group.name,
                    error=f"no answer within {FREE_MEMORY_TIMEOUT_S:g} s")
        return None
    found = re.search(rb"\d+", out)
    if process.returncode != 0 or found is None:
        log.warning("group.free_memory_failed", group=group.name, code=process.returncode,
                    output=(out or err)[:200].decode("utf-8", "replace").strip())
        return None
    return int(found.group())


Members = Callable[[str], Iterable[Member]]
Evict = Callable[[str], Awaitable[None]]
Settled = Callable[[str], Awaitable[None]]


class Groups:
    """Every [groups] entry, and the turns and room of their loads."""

    def __init__(self, groups: dict[str, GroupConfig], members: Members, evict: Evict,
                 settled: Settled) -> None:
        self.groups = {name: Group(config) for name, config in groups.items()}
        self._members = members  # the slots of a group, but the one that loads
        self._evict = evict  # unloads a slot (reason: evicted); returns once its process is gone
        self._settled = settled  # returns once a stopping slot's process is gone

    def get(self, name: str | None) -> Group | None:
        return self.groups.get(name or "")

    def replace(self, groups: dict[str, GroupConfig]) -> None:
        """A reload's [groups]; a group whose limits changed keeps its turn order."""
        kept = {name: self.groups[name] for name in groups if name in self.groups}
        for name, config in groups.items():
            kept.setdefault(name, Group(config)).config = config
        self.groups = kept

    @contextlib.asynccontextmanager
    async def turn(self, config: SlotConfig, *, pinned: bool) -> AsyncIterator[None]:
        """The group's turn for `config`'s start, with room made for it; no group, no wait.
        A `pinned` (always) slot starts even when no room can be made: the config check made
        sure the group's `always` slots fit together. Otherwise NoRoom says why not."""
        group = self.get(config.group)
        if group is None:
            yield
            return
        async with group.lock:
            try:
                await self._make_room(group, config)
            except NoRoom:
                if not pinned:
                    raise
            yield

    async def _make_room(self, group: Group, config: SlotConfig) -> None:
        limits = group.config
        need = config.memory_mib or 0
        while True:
            loaded = [m for m in self._members(limits.name) if m.slot.name != config.name
                      and m.slot.state in LOADED]
            used = sum(m.memory_mib for m in loaded)
            short = None
            if limits.max_loaded is not None and len(loaded) + 1 > limits.max_loaded:
                short = f"{len(loaded)} of max_loaded = {limits.max_loaded} loaded"
            elif limits.memory_mib is not None and used + need > limits.memory_mib:
                short = f"{used} of {limits.memory_mib} MiB in use, {need} MiB needed"
            elif limits.free_memory_command is not None:
                free = await free_memory_mib(limits)
                if free is not None and free < need:
                    short = f"{free} MiB free by free_memory_command, {need} MiB needed"
            if short is None:
                return
            stopping = [m for m in loaded if m.slot.state is SlotState.STOPPING]
            if stopping:
                await self._settled(stopping[0].slot.name)
                continue
            victim = self._victim(loaded)
            if victim is None:
                others = ("no other slot of the group is loaded" if not loaded else
                          "the loaded ones are start = 'always', never unloaded")
                raise NoRoom(f"no room in group {limits.name!r}: {short}; {others}")
            log.info("slot.evicting", slot=victim.slot.name, group=limits.name,
                     **{"for": config.name}, in_flight=victim.slot.in_flight, why=short)
            await self._evict(victim.slot.name)

    @staticmethod
    def _victim(loaded: list[Member]) -> Member | None:
        """The least recently used loaded on-demand slot, one with nothing in flight first."""
        candidates = [m for m in loaded if m.evictable and m.slot.state in EVICTABLE]
        if not candidates:
            return None
        return min(candidates, key=lambda m: (m.slot.in_flight > 0, m.last_used))
