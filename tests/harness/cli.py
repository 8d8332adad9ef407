"""hal0d's command line run for real, as a person types it: one-shot commands (check-config,
print-config) and the client commands that ask a running daemon."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path

from tests.harness.daemons import Hal0dProcess, serving

# The repository: tests/harness/ is two folders below it.
ROOT = Path(__file__).resolve().parent.parent.parent
CLI_DEADLINE_S = 20.0  # for a client command, and for the daemon it asks to start
# Ctrl-C ends --watch at once: well under the feed's 15 s heartbeat, which a quit that waits
# for the reader's next read would wait for.
QUIT_S = 3.0


def env_without(*names: str) -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key not in names}


def hal0d_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`hal0d ARGS` from the repository's root, to its end: its exit code and its output."""
    return subprocess.run(
        [sys.executable, "-m", "hal0d", *args], capture_output=True, text=True, timeout=30,
        cwd=ROOT, env=env,
    )


async def cli(*args: str, key: str | None = None) -> tuple[int, str, str]:
    """The real CLI, without the caller's HAL0D_API_KEY (`key`: this one instead), in a test
    with an event loop; returns (exit code, stdout, stderr)."""
    env = env_without("HAL0D_API_KEY")
    if key is not None:
        env["HAL0D_API_KEY"] = key
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hal0d", *args, cwd=ROOT, env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), CLI_DEADLINE_S)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


def row_of(table: str, name: str) -> list[str]:
    """The cells of the row named `name` in a table `hal0d status` printed."""
    for line in table.splitlines():
        cells = line.split()
        if cells and cells[0] == name:
            return cells
    raise AssertionError(f"no row {name!r} in:\n{table}")


def cli_daemon(config: Path, port: int) -> AbstractAsyncContextManager[Hal0dProcess]:
    """`hal0d serve --config config` (daemon_toml's) as a real process, without the caller's
    HAL0D_API_KEY in its environment, until the block ends."""
    return serving(config, port, within=CLI_DEADLINE_S, env=env_without("HAL0D_API_KEY"))
