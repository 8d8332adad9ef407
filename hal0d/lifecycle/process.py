"""A slot's process: started in a process group of its own that dies with hal0d, its output
logged line by line, stopped gracefully (SIGTERM to the group, SIGKILL after a grace).

Its exit is the process's own, told by the loop's child watcher (`ExitWatch`), not the end of
its output: a command such as `sh -c 'some-daemon & exec llama-server ...'` leaves the daemon
holding the output pipe after the server exits, and asyncio's own `Process.wait()` (up to
Python 3.11) waits for that pipe to close too. The output is read on by itself until whoever
holds it lets go.

Every slot with a command runs it through `Child`, started and stopped by the lifecycle manager
(manager.py) through the slot's runner (runner.py), `always` and `on_demand` slots alike.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import ctypes
import dataclasses
import os
import resource
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import cast

from hal0d.config import model_files
from hal0d.lifecycle.out_of_memory import OutOfMemory, out_of_memory
from hal0d.logs import get_logger
from hal0d.programs import resolve_program
from hal0d.transport import descriptors

log = get_logger()

STOP_GRACE_S = 10.0
OUTPUT_BLOCK = 65536
# After the exit, how long the output may take to reach its end (the lines the process wrote last
# are still in the pipe): past it, something the process started holds the pipe open, and the
# output is read on by itself.
OUTPUT_AFTER_EXIT_S = 0.5
MAX_LOGGED_LINE = 16384  # a longer line is logged cut, with the count of what was left out
# What a failed load's reason shows of the process's last output: these many lines, each cut.
SUMMARY_LINES = 3
SUMMARY_LINE = 300

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
PF_EXITING = 0x4  # <linux/sched.h>: set as a process starts to exit, before its files close
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


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def launch_problem(command: tuple[str, ...]) -> str | None:
    """What makes a launch fail for sure, seen before anything is unloaded to make room for it:
    a program that is not there or not executable, a model file the server is told to load
    (config.model_files) that does not exist. None: nothing known against it."""
    argv = resolve_program(command)
    program = argv[0]
    if os.sep not in program:
        return f"cannot start {program!r}: not found beside hal0d's Python or on PATH"
    if not os.path.isfile(program) or not os.access(program, os.X_OK):
        return f"cannot start {program!r}: no such executable file"
    for model in model_files(command):
        if not os.path.exists(model.path):
            return f"model file {model.path!r} ({model.option}) does not exist"
    return None


class LaunchFailed(Exception):
    """The command could not be started at all (a missing program, a refused exec)."""


class ExitWatch(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's own protocol for a process with pipes, which also resolves `exited` with the
    exit code as soon as the child watcher sees the exit, whether or not its pipes are closed."""

    def __init__(self, exited: asyncio.Future[int], limit: int,
                 loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=limit, loop=loop)
        self.exited = exited
        self.transport: asyncio.SubprocessTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transport is a SubprocessTransport by its methods, not by its class.
        self.transport = cast(asyncio.SubprocessTransport, transport)
        super().connection_made(transport)

    def process_exited(self) -> None:
        code = self.transport.get_returncode() if self.transport is not None else None
        if not self.exited.done() and code is not None:
            self.exited.set_result(code)
        super().process_exited()


def open_stat(pid: int) -> int | None:
    """A descriptor of the process's /proc/PID/stat; None where there is none (macOS), or
    when the process is gone already."""
    try:
        return os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class Child:
    """One run of a slot's command."""

    def __init__(self, slot: str, argv: list[str], process: asyncio.subprocess.Process,
                 exited: asyncio.Future[int], devices: tuple[int, ...] = ()) -> None:
        self.slot = slot
        self.argv = argv
        # The devices it was placed on, in the order it numbers them (its CUDA0 is the first):
        # what it says of "device 1" is said of devices[1].
        self.devices = devices
        self.process = process
        self.pid = process.pid
        self._exited = exited
        # Its /proc/PID/stat, kept open from the start: `running` re-reads it with one pread
        # per request (opening it each time costs five times that).
        self._stat = open_stat(self.pid)
        exited.add_done_callback(self._close_stat)
        # The last lines it printed: a failed load names them (exit_summary).
        self.last_lines: collections.deque[str] = collections.deque(maxlen=SUMMARY_LINES)
        # Its lines are logged at info while it loads (what went wrong is there), at debug once
        # it answers (llama-server writes several lines a request): answering().
        self._line_level = log.info
        # What it said of device memory it could not have while it loaded: the first such
        # line that names a size, else the first at all (out_of_memory.py).
        self.out_of_memory: OutOfMemory | None = None
        self._loading = True  # until it answers: what it says of memory is read meanwhile
        # In a context of its own: the request that asked for the load is not the one its
        # later lines are about (`journalctl -g request_id=` must not mix them in).
        self._output = asyncio.create_task(self._log_output(), context=contextvars.Context())

    @classmethod
    async def start(cls, slot: str, command: tuple[str, ...],
                    env: Mapping[str, str] | None = None,
                    devices: tuple[int, ...] = ()) -> Child:
        """`command` started, with `env` beside hal0d's environment, on `devices` (placement:
        the environment or the command names them)."""
        argv = resolve_program(command)
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[int] = loop.create_future()
        try:
            # asyncio.create_subprocess_exec, with the protocol that tells the exit itself.
            transport, protocol = await loop.subprocess_exec(
                lambda: ExitWatch(exited, OUTPUT_BLOCK, loop),
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **env} if env else None,
                start_new_session=True,  # its own process group: stop() ends its children too
                preexec_fn=child_setup(),  # and a kill -9 of hal0d ends the process itself
            )
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"cannot start {argv[0]!r}: {getattr(exc, 'strerror', None) or exc}"
            log.error("slot.process_failed", slot=slot, argv=argv, error=str(exc), reason=reason)
            raise LaunchFailed(reason) from None
        process = asyncio.subprocess.Process(transport, protocol, loop)
        log.info("slot.process_started", slot=slot, pid=process.pid, argv=argv,
                 **({"env": dict(env)} if env else {}))
        return cls(slot, argv, process, exited, devices)

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def running(self) -> bool:
        """Whether the process runs now, asked of the kernel, not of the loop's child watcher:
        the watcher tells an exit a moment after it happened, and a dying process's listener
        is closed before it is even a zombie, so in that moment its port is free for another
        program to take. The kernel marks a process exiting (PF_EXITING, in /proc/PID/stat)
        before it closes its files: from the instant its listener may be gone, it is not
        running here. Where there is no /proc (macOS), what the watcher told stands."""
        if self._exited.done():
            return False
        if self._stat is None:
            return True
        try:
            stat = os.pread(self._stat, 1024, 0)
        except ProcessLookupError:
            return False  # reaped
        # After the name (which may hold spaces and parentheses): state, ppid, pgrp, session,
        # tty_nr, tpgid, flags.
        fields = stat.rpartition(b")")[2].split()
        return fields[0] not in (b"Z", b"X") and not int(fields[6]) & PF_EXITING

    def _close_stat(self, _: object) -> None:
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None

    async def wait(self) -> int:
        """The exit code, once the process is gone and the output it wrote is logged (the
        output that something it started still writes is logged on as it comes)."""
        code = await asyncio.shield(self._exited)
        await asyncio.wait({self._output}, timeout=OUTPUT_AFTER_EXIT_S)
        return code

    async def exited_within(self, timeout_s: float) -> bool:
        """Whether the process is seen to exit within `timeout_s`."""
        done, _ = await asyncio.wait({self._exited}, timeout=timeout_s)
        return bool(done)

    def answering(self) -> None:
        """It answers: what it prints from now on is about requests, logged at debug."""
        self._line_level = log.debug
        self._loading = False

    @property
    def last_line(self) -> str | None:
        return self.last_lines[-1] if self.last_lines else None

    def exit_summary(self, code: int | None) -> str:
        """The exit code and the last few lines the process printed: a server's real error is
        often a line or two above its closing usage hint."""
        if code is not None and code < 0:
            # Killed: its last lines are whatever it was doing, not why it ended.
            return f"process killed by signal {-code} ({signal_name(-code)})"
        summary = f"process exited with code {code}"
        if self.out_of_memory is not None:
            summary = f"{self.out_of_memory}; {summary}"
        if not self.last_lines:
            return summary
        shown = [line if len(line) <= SUMMARY_LINE else line[:SUMMARY_LINE] + " [...]"
                 for line in self.last_lines]
        return f"{summary}: " + " | ".join(shown)

    async def stop(self, grace_s: float = STOP_GRACE_S) -> int | None:
        """SIGTERM to its group, SIGKILL after `grace_s`; returns once it is gone."""
        if self.process.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGTERM)
                async with asyncio.timeout(grace_s):
                    await asyncio.shield(self._exited)
            except TimeoutError:
                self.kill()
                await asyncio.shield(self._exited)
            except ProcessLookupError:
                pass
        code = await self.wait()
        log.info("slot.process_stopped", slot=self.slot, code=code)
        return code

    def kill(self) -> None:
        """SIGKILL to its group at once (hal0d is going away and cannot wait)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)

    async def abandon(self) -> None:
        """Cancelled with the process still running: it must not outlive hal0d, and its
        output will not end while it runs."""
        if self.process.returncode is None:
            self.kill()
            self._output.cancel()
        await asyncio.gather(self._output, return_exceptions=True)

    async def _log_output(self) -> None:
        """Every line of the process's output, logged. Read in blocks and split here: readline()
        gives up on a line over 64 KiB (vLLM logs whole prompts), and a pipe nobody reads any
        more blocks the process on its next write."""
        stdout = self.process.stdout
        assert stdout is not None
        pending = b""
        while block := await stdout.read(OUTPUT_BLOCK):
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
            self.last_lines.append(text)
            self._line_level("slot.process_output", slot=self.slot, line=text)
            if self._loading:
                self._note_out_of_memory(text)

    def _note_out_of_memory(self, text: str) -> None:
        found = out_of_memory(text)
        if found is None or (self.out_of_memory is not None and (
                self.out_of_memory.asked_mib is not None or found.asked_mib is None)):
            return
        if found.device is not None and found.device < len(self.devices):
            found = dataclasses.replace(found, device=self.devices[found.device])
        self.out_of_memory = found
        log.warning("slot.load_out_of_memory", slot=self.slot, asked_mib=found.asked_mib,
                    device=found.device, line=text)
