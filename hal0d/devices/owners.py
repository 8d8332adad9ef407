"""Which slot a process on a device belongs to, read from /proc.

A slot's command runs in a process group of its own, its process the group's leader (lifecycle/
process.py), so what the command starts (a wrapper script's server, vLLM's engine workers) is in
that group, and what leaves the group (a daemon that calls setsid) is still the leader's
descendant. A process is a slot's when it is the slot's process, is in its group, or descends
from it. Anything else is another program's: a desktop, a game, a process hal0d may not see in
/proc (another user's under systemd's ProtectProc=invisible, another PID namespace's).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

# A chain of parents longer than this is not followed further (a loop cannot happen in /proc,
# but a walk must end whatever the file says).
MAX_ANCESTORS: Final = 64


def parent_and_group(pid: int) -> tuple[int, int] | None:
    """(its parent's pid, its process group) from /proc/PID/stat; None when it cannot be read
    (gone, or not ours to see)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            text = stat.read()
    except OSError:
        return None
    # After the name (which may hold spaces and parentheses): state, ppid, pgrp.
    fields = text.rpartition(b")")[2].split()
    try:
        return int(fields[1]), int(fields[2])
    except (IndexError, ValueError):
        return None


def owner_of(pid: int, leaders: Mapping[int, str]) -> str | None:
    """The slot `pid` belongs to, given each slot's process pid (`leaders`: pid -> slot)."""
    if pid in leaders:
        return leaders[pid]
    seen = pid
    for _ in range(MAX_ANCESTORS):
        found = parent_and_group(seen)
        if found is None:
            return None
        parent, group = found
        if group in leaders:
            return leaders[group]
        if parent in leaders:
            return leaders[parent]
        if parent <= 1:
            return None
        seen = parent
    return None
