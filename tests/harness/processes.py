"""Processes as /proc shows them: whether one runs, the stub processes a test's slots started,
and what a test started and lost track of (the session's guard kills and names those)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Self


def process_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) from /proc/<pid>/stat; None once the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may hold spaces and ')': the fields resume after the last.
    state, ppid = stat[stat.rindex(")") + 2:].split()[:2]
    return state, int(ppid)


def command_line(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not), without reaping it: a slot process of an
    in-process hal0d is the test process's child, and its exit status is hal0d's to collect."""
    state = process_state(pid)
    return state is not None and state[0] != "Z"


def running(pid: int) -> bool:
    """Whether `pid` still runs. A zombie does not: it is reaped here if it is ours to reap (a
    child of the test process, or an orphan re-parented to it, the subreaper)."""
    state = process_state(pid)
    if state is not None and state[0] == "Z":
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return state is not None


def reap_zombie_children() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def live_children(parent: int) -> dict[int, str]:
    """Every running process whose parent is `parent`, with its command line."""
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        pid = int(entry.name) if entry.name.isdigit() else 0
        state = process_state(pid) if pid else None
        if state is not None and state[1] == parent and state[0] != "Z":
            found[pid] = command_line(pid)
    return found


def kill_with_its_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGKILL)


def kill_leftover_children(within_s: float) -> dict[int, str]:
    """Kills every living child of this process (their process groups too, then again for
    whatever they orphaned) until none is left or `within_s` has passed; returns them all."""
    leaked: dict[int, str] = {}
    deadline = time.monotonic() + within_s
    while True:
        reap_zombie_children()
        alive_now = live_children(os.getpid())
        if not alive_now or time.monotonic() > deadline:
            return {**leaked, **alive_now}
        leaked.update(alive_now)
        for pid in alive_now:
            kill_with_its_group(pid)
        time.sleep(0.05)  # the next round's /proc scan waits for the kills to land


def stub_pids(marker: str) -> set[int]:
    """The living stub processes whose command line names `marker` (the test's tmp_path)."""
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = cmdline.read().split(b"\0")
        except OSError:
            continue
        if b"stub" in argv and any(marker.encode() in arg for arg in argv) and alive(int(entry)):
            found.add(int(entry))
    return found


class ProcessSampler(threading.Thread):
    """Counts the living stub processes every 10 ms from a thread of its own, so a busy event
    loop cannot make it miss an overlap."""

    def __init__(self, marker: str) -> None:
        super().__init__(daemon=True)
        self.marker = marker
        self.samples = 0
        self.most_alive = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.01):
            self.most_alive = max(self.most_alive, len(stub_pids(self.marker)))
            self.samples += 1

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self.join()
