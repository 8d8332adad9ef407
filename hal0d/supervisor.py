"""Slot supervision: the processes hal0d starts for slots, and the health probe of every slot.

A slot with a `command` is launched at startup, is `starting` until its upstream answers
GET /v1/models, and is restarted with exponential backoff when it exits. Every slot is probed
periodically; the probe moves it between `ready` and `error`. Requests never wait for any of this:
the server listens at once and requests for a starting slot queue until it is ready.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp

from hal0d.child import Child, LaunchFailed, resolve_program
from hal0d.config import GroupConfig, SlotConfig
from hal0d.loader import Loader, Model, UnloadReason
from hal0d.logs import get_logger
from hal0d.probe import answers_within, probe
from hal0d.slots import Slot, SlotState, SlotTable

log = get_logger()

PROBE_INTERVAL_S = 10.0
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RUN_S = 60.0  # a process that ran this long restarts from the first backoff step again
def log_state_change(slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
    if new == SlotState.SERVING or (old == SlotState.SERVING and new == SlotState.READY):
        return  # every lease would log twice; in_flight is in /api/slots and /metrics instead
    level = log.warning if new == SlotState.ERROR else log.info
    level("slot.state_changed", slot=slot.name, old=str(old), new=str(new), reason=reason)


class SlotProcess:
    """Runs one `always` slot's command, restarting it with backoff while hal0d runs."""

    def __init__(self, slot: Slot, config: SlotConfig, session: aiohttp.ClientSession) -> None:
        self.slot = slot
        self.config = config
        self.session = session
        self.child: Child | None = None
        self.restarts = 0
        self._stopping = False
        # Why the last launch failed before any process existed (a missing program): the
        # slot's reason says so, not a meaningless exit code.
        self.launch_error: str | None = None

    @property
    def process(self) -> asyncio.subprocess.Process | None:
        return self.child.process if self.child is not None else None

    async def run(self) -> None:
        backoff = BACKOFF_FIRST_S
        while not self._stopping:
            started = time.monotonic()
            code = await self._run_once()
            if self._stopping:
                return
            ran = time.monotonic() - started
            if ran >= HEALTHY_RUN_S:
                backoff = BACKOFF_FIRST_S
            self.restarts += 1
            if self.launch_error is not None:
                self.slot.mark_error(f"{self.launch_error}; retrying in {backoff:g} s")
            else:
                log.warning(
                    "slot.process_exited", slot=self.slot.name, code=code, ran_s=round(ran, 1),
                    restart_in_s=backoff, restarts=self.restarts,
                )
                self.slot.mark_error(
                    f"process exited with code {code}; restarting in {backoff:g} s"
                )
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _run_once(self) -> int | None:
        command = self.config.command or ()
        launching = "launching " + " ".join(resolve_program(command))
        if self.launch_error is not None:
            launching += f" (the last attempt failed: {self.launch_error})"
        self.slot.mark_starting(launching)
        try:
            child = self.child = await Child.start(self.slot.name, command)
        except LaunchFailed as exc:
            self.launch_error = str(exc)
            return None
        self.launch_error = None
        waiting = asyncio.create_task(self._await_ready())
        try:
            if self._stopping:
                # stop() ran while the process was being created, and found none to stop.
                await self.stop()
            return await child.wait()
        finally:
            waiting.cancel()
            await child.abandon()
            await asyncio.gather(waiting, return_exceptions=True)

    async def _await_ready(self) -> None:
        timeout_s = self.config.load_timeout_s
        if await answers_within(self.session, self.config, timeout_s):
            self.slot.mark_ready()
        else:
            self.slot.mark_error(f"not answering after {timeout_s:g} s")

    async def stop(self) -> None:
        self._stopping = True
        if self.child is not None:
            await self.child.stop()  # none yet: _run_once stops it as soon as it exists


class Supervisor:
    """All slot processes and the periodic probe of one application."""

    def __init__(
        self,
        table: SlotTable,
        configs: tuple[SlotConfig, ...],
        session: aiohttp.ClientSession,
        *,
        groups: dict[str, GroupConfig] | None = None,
        end_streams: Callable[[str, str], int] = lambda slot, reason: 0,
    ) -> None:
        self.table = table
        self.configs = {c.name: c for c in configs}
        self.session = session
        self.processes = {
            c.name: SlotProcess(table[c.name], c, session)
            for c in configs if c.command and not c.on_demand
        }
        # The on-demand slots' processes: started for a request, stopped when idle.
        self.loader = Loader(table, configs, groups or {}, session, end_streams)
        # Told of each slot a reload adds, once the loader has it (the event feed watches it).
        self.slot_added: list[Callable[[Slot], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    def restarts(self) -> dict[str, int]:
        """How often each `always` slot's process was restarted since hal0d started."""
        return {name: process.restarts for name, process in self.processes.items()}

    def slot_view(self, slot: Slot) -> dict[str, Any]:
        """A slot as /api/slots and the event feed show it."""
        view = slot.snapshot()
        config = self.configs.get(slot.name)
        view["group"] = config.group if config else None
        view["memory_mib"] = config.memory_mib if config else None
        group = self.loader.groups.get(config.group) if config and config.group else None
        view["group_memory_mib"] = group.config.memory_mib if group else None
        view["group_max_loaded"] = group.config.max_loaded if group else None
        if slot.name in self.loader.models:
            view.update(self.loader.snapshot(slot.name))
        return view

    async def probe_once(self, name: str) -> None:
        slot = self.table.get(name)
        if slot is None:
            return  # removed by a reload while this probe round was starting
        if slot.state in (SlotState.STARTING, SlotState.OFFLINE) and name in self.processes:
            return  # the process's own startup wait owns these states
        if name in self.loader.models and slot.state not in (SlotState.READY, SlotState.ERROR):
            return  # the loader owns an on-demand slot's state until its model is loaded
        if name in self.processes and self.processes[name].launch_error is not None:
            return  # nothing could be started: "cannot connect" would hide the real cause
        if slot.in_flight:
            # Requests in flight already show the upstream alive (the stall guard watches them),
            # and llama-cpp-python's server interrupts a running completion for any request.
            return
        config = self.configs[name]
        reason = await probe(self.session, config)
        if self.table.get(name) is not slot or self.configs.get(name) is not config:
            return  # a reload replaced the slot meanwhile: this answer is about the old one
        if slot.state is SlotState.STARTING and name in self.processes:
            return  # a reload is bringing up a new process; its own startup wait decides
        if name in self.loader.models and slot.state not in (SlotState.READY, SlotState.ERROR):
            return  # loaded or unloaded meanwhile
        if reason is None:
            slot.mark_ready()
        else:
            slot.mark_error(reason)

    async def start(self) -> None:
        for process in self.processes.values():
            self._tasks.append(asyncio.create_task(process.run()))
        plain = [name for name in self.configs
                 if name not in self.processes and name not in self.loader.models]
        await asyncio.gather(*(self.probe_once(name) for name in plain))
        self._tasks.append(asyncio.create_task(self._probe_forever()))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self.probe_once(name) for name in self.configs))

    async def stop(self) -> None:
        await asyncio.gather(self.loader.stop(), *(p.stop() for p in self.processes.values()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.table:
            slot.mark_offline()

    async def reload(
        self,
        configs: tuple[SlotConfig, ...],
        *,
        drain_s: float = 900.0,
        groups: dict[str, GroupConfig] | None = None,
    ) -> dict[str, list[str]]:
        """Apply a reloaded [[slots]] list; returns the slot names added, removed and changed.

        New slots join the table and are probed (or launched) before this returns; everything
        after those awaits runs in one step, and the caller swaps the Runtime right after, so no
        request is ever routed to a slot missing from the table. Removed slots go offline (their
        queued requests get a 503) and leave the table. A slot whose command or upstream changed
        gets a new process, but the old one is stopped only once the leases it serves are
        released (for at most `drain_s`), so in-flight streams finish on the old settings; the
        slot is `starting` meanwhile, so new requests queue for the new process instead.
        """
        new = {c.name: c for c in configs}
        added = [name for name in new if name not in self.configs]
        removed = [name for name in self.configs if name not in new]
        changed = [name for name in new if name in self.configs and new[name] != self.configs[name]]
        self.loader.set_groups(groups or {})
        await self._add_slots([new[name] for name in added], drain_s)
        # From here to the return there is no await: the table and the caller's new Runtime
        # change in the same step of the event loop.
        for name in removed:
            self._remove_slot(name, drain_s)
        for name in changed:
            self._change_slot(new[name], drain_s)
        return {"added": added, "removed": removed, "changed": changed}

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run `coro` as one of the supervisor's tasks (stop() cancels them), forgetting the
        ones that ended."""
        self._tasks[:] = [task for task in self._tasks if not task.done()]
        self._tasks.append(asyncio.create_task(coro))

    async def _add_slots(self, configs: list[SlotConfig], drain_s: float) -> None:
        """New slots join the table; plain ones are probed before this returns, commands are
        launched (an `always` one once its group has room)."""
        # Whatever listener contexts.slots_context wired into the first slots, new slots get it.
        listener = next((slot.on_change for slot in self.table), log_state_change)
        for config in configs:
            name = config.name
            self.table.add(Slot(config, on_change=listener))
            self.configs[name] = config
            self.loader.add(config)  # an `always` one too: it counts in its group's limits
            if config.command and not config.on_demand:
                launched = SlotProcess(self.table[name], config, self.session)
                self.processes[name] = launched
                self._spawn(self._start_always(self.table[name], None, launched, drain_s))
            for tell in self.slot_added:
                tell(self.table[name])
        await asyncio.gather(*(
            self.probe_once(config.name) for config in configs
            if config.name not in self.processes and config.name not in self.loader.models
        ))

    def _remove_slot(self, name: str, drain_s: float) -> None:
        """The slot goes offline and leaves the table now; its process or model is stopped once
        its leases are released."""
        slot = self.table.remove(name)
        del self.configs[name]
        slot.mark_offline()
        process = self.processes.pop(name, None)
        if process is not None:
            self._spawn(self._retire(slot, process, None, drain_s, probe_after=False))
        model = self.loader.retire(name)
        if model is not None:
            self._spawn(self._retire_model(slot, model, drain_s))

    def _change_slot(self, after: SlotConfig, drain_s: float) -> None:
        name = after.name
        before = self.configs[name]
        slot = self.table[name]
        slot.reconfigure(after)  # limits and the admin view; leases already held keep counting
        self.configs[name] = after
        if before.on_demand or after.on_demand:
            self._change_lifecycle(slot, before, after, drain_s)
            return
        self.loader.reconfigure(after)  # its group and memory_mib count in its group's limits
        process = self.processes.get(name)
        if (before.command, before.upstream) == (after.command, after.upstream):
            if process is not None:
                process.config = after  # the probe's credentials
            return
        successor = SlotProcess(slot, after, self.session) if after.command else None
        if successor is not None:
            self.processes[name] = successor
            slot.mark_starting("reloaded: a new process for the changed command or upstream")
        else:
            self.processes.pop(name, None)
        self._spawn(self._retire(slot, process, successor, drain_s,
                                 probe_after=successor is None))

    async def _retire(
        self, slot: Slot, old: SlotProcess | None, successor: SlotProcess | None,
        drain_s: float, *, probe_after: bool,
    ) -> None:
        """Stop a removed or replaced slot's old process once its leases are released (for at
        most drain_s), then run its successor or probe the slot."""
        if old is not None:
            try:
                await self._drain(slot, drain_s)
            finally:
                # Also when cancelled by stop(): the old process is in no table any more.
                await old.stop()
        if successor is not None:
            await successor.run()
        elif probe_after:
            await self.probe_once(slot.name)

    def _change_lifecycle(
        self, slot: Slot, before: SlotConfig, after: SlotConfig, drain_s: float
    ) -> None:
        """A reloaded slot that is or becomes on demand. Its in-flight requests finish on the
        old process; a changed command or upstream is loaded by the next request."""
        name = slot.name
        new_process = (before.command, before.upstream) != (after.command, after.upstream)
        if before.on_demand and after.on_demand:
            self.loader.reconfigure(after)
            if new_process and slot.state in (SlotState.READY, SlotState.SERVING,
                                              SlotState.ERROR, SlotState.STARTING):
                self.loader.unload_soon(name, UnloadReason.RELOAD)
            return
        if after.on_demand:  # always -> on demand: drain the running process, then rest
            process = self.processes.pop(name, None)
            if slot.state not in (SlotState.STOPPED, SlotState.STOPPING, SlotState.OFFLINE):
                slot.transition(SlotState.STOPPING, "reloaded: now started on demand")
            self.loader.add(after)
            self._spawn(self._rest_on_demand(slot, process, drain_s))
            return
        # on demand -> always: unload, then the supervisor runs and restarts the command.
        model = self.loader.retire(name)
        self.loader.reconfigure(after)  # pinned now: it counts in its group's limits
        successor = SlotProcess(slot, after, self.session)
        self.processes[name] = successor
        if slot.state in (SlotState.READY, SlotState.SERVING, SlotState.ERROR):
            slot.transition(SlotState.STOPPING, "reloaded: now started with hal0d")
        self._spawn(self._start_always(slot, model, successor, drain_s))

    async def _drain(self, slot: Slot, drain_s: float) -> None:
        if slot.in_flight:
            log.info("slot.draining", slot=slot.name, in_flight=slot.in_flight)
        try:
            async with asyncio.timeout(drain_s):
                await slot.drained()
        except TimeoutError:
            log.warning("slot.drain_timeout", slot=slot.name, in_flight=slot.in_flight,
                        drain_s=drain_s)

    async def _retire_model(self, slot: Slot, model: Model, drain_s: float) -> None:
        try:
            await self._drain(slot, drain_s)
        finally:
            await self.loader.stop_model(model, UnloadReason.RELOAD)

    async def _rest_on_demand(
        self, slot: Slot, process: SlotProcess | None, drain_s: float
    ) -> None:
        await self._drain(slot, drain_s)
        if process is not None:
            await process.stop()
        if slot.state is SlotState.STOPPING:
            slot.transition(SlotState.STOPPED, "reloaded: loads on the next request")
        self.loader.load_if_wanted(slot)

    async def _start_always(
        self, slot: Slot, model: Model | None, successor: SlotProcess, drain_s: float
    ) -> None:
        await self._drain(slot, drain_s)
        if model is not None:
            await self.loader.stop_model(model, UnloadReason.RELOAD)
        if slot.state is SlotState.STOPPING:
            slot.transition(SlotState.STOPPED, "reloaded")
        async with self.loader.room_for(successor.config):
            slot.mark_starting("reloaded: now started with hal0d")
        await successor.run()
