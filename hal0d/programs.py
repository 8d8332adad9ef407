"""The programs a config names, found and run the one way: a slot's command, a group's
free_memory_command, the [devices] devices_command.

`resolve_program` finds a bare program name beside hal0d's own Python first (its virtualenv), then
on PATH, so `command = ["hal0d", "stub", ...]` works however hal0d was installed. `run_program`
runs a short command that answers and exits (not a slot's server: lifecycle/process.py keeps
those): no stdin, its output read whole but bounded, ended by SIGKILL when it outlives its
timeout or prints more than it may. A program that printed too much or took too long is a
`ProgramFailed`, as one that cannot be started is: its output is not to be read at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# What is kept of a program's stderr: enough for the line that says why it failed.
STDERR_KEPT: Final = 4096
READ_BLOCK: Final = 65536
# How long a killed program is waited for before it is left to the loop's child watcher.
KILLED_EXIT_S: Final = 2.0


def resolve_program(argv: tuple[str, ...]) -> list[str]:
    """`argv` with its program looked up beside hal0d's Python, then on PATH; as written when
    it is a path or found in neither (starting it then says why)."""
    program = argv[0]
    if os.sep not in program:
        beside = Path(sys.executable).parent / program
        if beside.exists():
            return [str(beside), *argv[1:]]
        found = shutil.which(program)
        if found:
            return [found, *argv[1:]]
    return list(argv)


@dataclass(frozen=True, slots=True)
class Finished:
    """A program that exited by itself within its time: its exit code (negative: killed by
    that signal), its whole stdout and the first STDERR_KEPT bytes of its stderr."""

    code: int
    out: bytes
    err: bytes


class ProgramFailed(Exception):
    """The program gave no output to read: it could not be started, did not exit within its
    timeout, or printed more than it may. The message says which, in one line."""


async def run_program(command: tuple[str, ...], *, timeout_s: float,
                      max_output: int) -> Finished:
    """Runs `command` to its end; ProgramFailed when it cannot be started, is not done within
    `timeout_s` or prints more than `max_output` bytes on stdout (killed at once then: a
    runaway program's output is never held whole)."""
    argv = resolve_program(command)
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise ProgramFailed(f"cannot start {argv[0]!r}: {exc.strerror or exc}") from None
    assert process.stdout is not None and process.stderr is not None
    errors = asyncio.ensure_future(_bounded(process.stderr, STDERR_KEPT, drain=True))
    try:
        async with asyncio.timeout(timeout_s):
            out = await _bounded(process.stdout, max_output)
            if out is None:
                raise ProgramFailed(f"printed more than {max_output} bytes")
            err = await errors
            return Finished(await process.wait(), out, err or b"")
    except TimeoutError:
        raise ProgramFailed(f"no answer within {timeout_s:g} s") from None
    finally:
        errors.cancel()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            # Bounded: something the program started may hold its pipes open after it died.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(KILLED_EXIT_S):
                    await process.wait()


async def _bounded(stream: asyncio.StreamReader, limit: int, *, drain: bool = False
                   ) -> bytes | None:
    """What `stream` holds until its end, or None once it passed `limit` bytes; with `drain`,
    the first `limit` bytes and the rest read and dropped (a pipe nobody reads blocks its
    writer)."""
    kept = bytearray()
    while block := await stream.read(READ_BLOCK):
        if len(kept) + len(block) > limit:
            if not drain:
                return None
            kept += block[: max(0, limit - len(kept))]
            continue
        kept += block
    return bytes(kept)
