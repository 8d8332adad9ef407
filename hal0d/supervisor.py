"""Slot supervision: the processes hal0d starts for slots, and the health probe of every slot.

A slot with a `command` is launched at startup, is `starting` until its upstream answers
GET /v1/models, and is restarted with exponential backoff when it exits. Every slot is probed
periodically; the probe moves it between `ready` and `error`. Requests never wait for any of this:
the server listens at once and requests for a starting slot queue until it is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from hal0d import descriptors
from hal0d.appkeys import RUNTIME, SESSION, SLOTS, SUPERVISOR
from hal0d.config import SlotConfig
from hal0d.logs import get_logger
from hal0d.slots import Slot, SlotState, SlotTable
from hal0d.upstream import TRANSPORT_ERRORS, own_headers, transport_reason

log = get_logger()

PROBE_INTERVAL_S = 10.0
PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 0.2
STARTUP_TIMEOUT_S = 600.0  # a big model can take minutes to load
STOP_GRACE_S = 10.0
OUTPUT_BLOCK = 65536
MAX_LOGGED_LINE = 16384  # a longer line is logged cut, with the count of what was left out
BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 60.0
HEALTHY_RUN_S = 60.0  # a process that ran this long restarts from the first backoff step again
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# What a slot process gets when hal0d dies without stopping it (kill -9, OOM killer, a crash).
# SIGTERM, not SIGKILL: the parent-death signal reaches only the direct child, and hal0d's group
# kill died with hal0d, so only a process allowed to shut down takes its own children along
# (vLLM's engine workers, a wrapper script's server), as hal0d's own stop() asks it to first.
# Model servers end promptly on SIGTERM; one that ignores it is left to the service manager
# (the unit's KillMode=mixed ends whatever is left in hal0d's cgroup).
PARENT_DEATH_SIGNAL = signal.SIGTERM


def load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent (nothing should be loaded between fork and
    exec); None where there is no such call, and slot processes start without a death signal."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return prctl


PRCTL = load_prctl()


def die_with_hal0d() -> Callable[[], None] | None:
    """A preexec_fn that makes the child get PARENT_DEATH_SIGNAL when hal0d dies, however it dies.

    Both loops run it between fork and exec, and keep start_new_session too: asyncio's loop hands
    both to subprocess.Popen, and uvloop calls it from its fork handler before libuv's child setup
    calls setsid() for the detached flag (tests/test_process_hygiene.py checks both on both loops).

    The signal is tied to the *thread* that forked, not the process (prctl(2)): it fires when that
    thread ends. Both loops fork in the thread that runs them, synchronously inside
    create_subprocess_exec, and hal0d runs its loop in the main thread for its whole life
    (server.serve), so the thread ends only with the process. A loop run in a side thread would
    take its slot processes along when that thread ends, which is right too: nobody supervises
    them any more.

    hal0d has other threads (the history writer, to_thread), so the hook does only what cannot
    wait for a lock one of them held at the fork: a foreign call loaded beforehand, getppid, exit.
    """
    prctl = PRCTL
    if prctl is None:
        return None
    hal0d = os.getpid()  # before the fork: in the child this is the parent it must still have

    def set_parent_death_signal() -> None:
        if prctl(PR_SET_PDEATHSIG, int(PARENT_DEATH_SIGNAL), 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != hal0d:
            # hal0d died between the fork and the prctl, so the signal will never come: the
            # child is already an orphan and must not go on to start a model server.
            os._exit(1)

    return set_parent_death_signal


def child_setup() -> Callable[[], None] | None:
    """The preexec_fn of a slot process: the parent-death signal, and the open-files limit hal0d
    was started with (hal0d raised its own for its sockets; the model server raises its own if
    it needs to)."""
    die = die_with_hal0d()
    limit = descriptors.limit_for_children()
    if limit is None:
        return die

    def setup() -> None:
        if die is not None:
            die()
        resource.setrlimit(resource.RLIMIT_NOFILE, limit)  # one system call: safe after fork

    return setup


def resolve_program(argv: tuple[str, ...]) -> list[str]:
    """A bare program name is looked up beside hal0d's own Python first (its virtualenv), then
    on PATH, so `command = ["hal0d", "stub", ...]` works however hal0d was installed."""
    program = argv[0]
    if os.sep not in program:
        beside = Path(sys.executable).parent / program
        if beside.exists():
            return [str(beside), *argv[1:]]
        found = shutil.which(program)
        if found:
            return [found, *argv[1:]]
    return list(argv)


def log_state_change(slot: Slot, old: SlotState, new: SlotState, reason: str | None) -> None:
    if new == SlotState.SERVING or (old == SlotState.SERVING and new == SlotState.READY):
        return  # every lease would log twice; in_flight is in /api/slots and /metrics instead
    level = log.warning if new == SlotState.ERROR else log.info
    level("slot.state_changed", slot=slot.name, old=str(old), new=str(new), reason=reason)


async def probe(session: aiohttp.ClientSession, config: SlotConfig) -> str | None:
    """None when the upstream answers GET /v1/models, else why not."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with session.get(
                config.upstream + "/v1/models", headers=own_headers(config)
            ) as resp:
                await resp.read()
                if resp.status >= 500:
                    return f"GET /v1/models answered {resp.status}"
                return None
    except TRANSPORT_ERRORS as exc:
        # A reason, not an error: no request is waiting on the probe. A probe short of a
        # descriptor is not counted as a refused request either.
        return transport_reason(exc, "waiting for GET /v1/models")


class SlotProcess:
    """Runs one slot's command, restarting it with backoff while hal0d runs."""

    def __init__(self, slot: Slot, config: SlotConfig, session: aiohttp.ClientSession) -> None:
        self.slot = slot
        self.config = config
        self.session = session
        self.process: asyncio.subprocess.Process | None = None
        self.restarts = 0
        self._stopping = False
        # Why the last launch failed before any process existed (a missing program): the
        # slot's reason says so, not a meaningless exit code.
        self.launch_error: str | None = None

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
        argv = resolve_program(self.config.command or ())
        launching = "launching " + " ".join(argv)
        if self.launch_error is not None:
            launching += f" (the last attempt failed: {self.launch_error})"
        self.slot.mark_starting(launching)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop() ends its children too
                preexec_fn=child_setup(),  # and a kill -9 of hal0d ends the process itself
            )
        except (OSError, subprocess.SubprocessError) as exc:
            self.launch_error = f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}"
            log.error("slot.process_failed", slot=self.slot.name, argv=argv, error=str(exc),
                      reason=self.launch_error, restarts=self.restarts)
            return None
        self.launch_error = None
        log.info("slot.process_started", slot=self.slot.name, pid=self.process.pid, argv=argv)
        output = asyncio.create_task(self._log_output(self.process))
        waiting = asyncio.create_task(self._await_ready())
        try:
            if self._stopping:
                # stop() ran while the process was being created, and found none to stop.
                await self.stop()
            await self.process.wait()
        finally:
            waiting.cancel()
            if self.process.returncode is None:
                # Cancelled (hal0d is going away) with the process still running: it must
                # not outlive us, and its output will not end while it runs.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                output.cancel()
            await asyncio.gather(output, waiting, return_exceptions=True)
        return self.process.returncode

    async def _await_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if await probe(self.session, self.config) is None:
                self.slot.mark_ready()
                return
            await asyncio.sleep(STARTUP_POLL_S)
        self.slot.mark_error(f"not answering after {STARTUP_TIMEOUT_S:g} s")

    async def _log_output(self, process: asyncio.subprocess.Process) -> None:
        """Every line of the process's output, logged. Read in blocks and split here: readline()
        gives up on a line over 64 KiB (vLLM logs whole prompts), and a pipe nobody reads any
        more blocks the process on its next write."""
        assert process.stdout is not None
        pending = b""
        while block := await process.stdout.read(OUTPUT_BLOCK):
            *lines, pending = (pending + block).split(b"\n")
            if len(pending) > MAX_LOGGED_LINE:
                lines.append(pending)
                pending = b""
            for line in lines:
                self._log_line(line)
        self._log_line(pending)

    def _log_line(self, line: bytes) -> None:
        text = line[:MAX_LOGGED_LINE].decode("utf-8", "replace").rstrip()
        if len(line) > MAX_LOGGED_LINE:
            text += f" [... {len(line) - MAX_LOGGED_LINE} more bytes]"
        if text:
            log.info("slot.process_output", slot=self.slot.name, line=text)

    async def stop(self) -> None:
        self._stopping = True
        process = self.process
        if process is None or process.returncode is not None:
            return  # none yet: _run_once stops it as soon as it exists
        try:
            os.killpg(process.pid, signal.SIGTERM)
            async with asyncio.timeout(STOP_GRACE_S):
                await process.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        except ProcessLookupError:
            pass
        log.info("slot.process_stopped", slot=self.slot.name, code=process.returncode)


class Supervisor:
    """All slot processes and the periodic probe of one application."""

    def __init__(self, table: SlotTable, configs: tuple[SlotConfig, ...],
                 session: aiohttp.ClientSession) -> None:
        self.table = table
        self.configs = {c.name: c for c in configs}
        self.session = session
        self.processes = {
            c.name: SlotProcess(table[c.name], c, session) for c in configs if c.command
        }
        self._tasks: list[asyncio.Task[None]] = []

    async def probe_once(self, name: str) -> None:
        slot = self.table.get(name)
        if slot is None:
            return  # removed by a reload while this probe round was starting
        if slot.state in (SlotState.STARTING, SlotState.OFFLINE) and name in self.processes:
            return  # the process's own startup wait owns these states
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
        if reason is None:
            slot.mark_ready()
        else:
            slot.mark_error(reason)

    async def start(self) -> None:
        for process in self.processes.values():
            self._tasks.append(asyncio.create_task(process.run()))
        plain = [name for name in self.configs if name not in self.processes]
        await asyncio.gather(*(self.probe_once(name) for name in plain))
        self._tasks.append(asyncio.create_task(self._probe_forever()))

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL_S)
            await asyncio.gather(*(self.probe_once(name) for name in self.configs))

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes.values()))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for slot in self.table:
            slot.mark_offline()

    async def reload(
        self, configs: tuple[SlotConfig, ...], *, drain_s: float = 900.0
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
        # Whatever listener slots_context wired into the first slots, new slots get it too.
        listener = next((slot.on_change for slot in self.table), log_state_change)

        async def retire(slot: Slot, old: SlotProcess | None, successor: SlotProcess | None,
                         probe_after: bool) -> None:
            if old is not None:
                try:
                    if slot.in_flight:
                        log.info("slot.draining", slot=slot.name, in_flight=slot.in_flight)
                    async with asyncio.timeout(drain_s):
                        # Polled: a slot has no event for "last lease released" in STARTING.
                        while slot.in_flight:  # noqa: ASYNC110
                            await asyncio.sleep(STARTUP_POLL_S)
                except TimeoutError:
                    log.warning("slot.drain_timeout", slot=slot.name, in_flight=slot.in_flight,
                                drain_s=drain_s)
                finally:
                    # Also when cancelled by stop(): the old process is in no table any more.
                    await old.stop()
            if successor is not None:
                await successor.run()
            elif probe_after:
                await self.probe_once(slot.name)

        def spawn(coro: Coroutine[Any, Any, None]) -> None:
            self._tasks[:] = [task for task in self._tasks if not task.done()]
            self._tasks.append(asyncio.create_task(coro))

        for name in added:
            self.table.add(Slot(new[name], on_change=listener))
            self.configs[name] = new[name]
            if new[name].command:
                launched = SlotProcess(self.table[name], new[name], self.session)
                self.processes[name] = launched
                spawn(launched.run())
        await asyncio.gather(
            *(self.probe_once(name) for name in added if name not in self.processes)
        )

        # From here to the return there is no await: the table and the caller's new Runtime
        # change in the same step of the event loop.
        for name in removed:
            slot = self.table.remove(name)
            del self.configs[name]
            slot.mark_offline()
            process = self.processes.pop(name, None)
            if process is not None:
                spawn(retire(slot, process, None, probe_after=False))
        for name in changed:
            before, after = self.configs[name], new[name]
            slot = self.table[name]
            slot.reconfigure(after)  # limits and the admin view; leases already held keep counting
            self.configs[name] = after
            process = self.processes.get(name)
            if (before.command, before.upstream) == (after.command, after.upstream):
                if process is not None:
                    process.config = after  # the probe's credentials
                continue
            successor = SlotProcess(slot, after, self.session) if after.command else None
            if successor is not None:
                self.processes[name] = successor
                slot.mark_starting("reloaded: a new process for the changed command or upstream")
            else:
                self.processes.pop(name, None)
            spawn(retire(slot, process, successor, probe_after=successor is None))
        return {"added": added, "removed": removed, "changed": changed}


async def slots_context(app: web.Application) -> AsyncIterator[None]:
    """cleanup_ctx: the slot table, its processes and its probe, stopped on shutdown."""
    configs = app[RUNTIME].current.config.slots
    table = SlotTable(configs, on_change=log_state_change)
    app[SLOTS] = table
    supervisor = Supervisor(table, configs, app[SESSION])
    app[SUPERVISOR] = supervisor
    await supervisor.start()
    yield
    await supervisor.stop()
