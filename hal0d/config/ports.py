"""`{free_port}` in a slot: a free loopback port picked for it, and the same one again on reload.

The demo's stub must not collide with whatever else runs on the machine, so its config names no
port and hal0d picks one. The pick is remembered for the life of the process (this module's one
piece of state): a reload that reads the same slot again must name the same port, or the
unchanged slot would look changed and be restarted.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path
from typing import Any

# Written in a slot's `upstream` and `command`: a free loopback port hal0d picks for that slot.
FREE_PORT = "{free_port}"
# The port picked per (config folder, slot name, upstream as written), kept for the process's
# life: a reload of an unchanged slot names the same port (the slot is not restarted).
_picked_ports: dict[tuple[str, str, str], int] = {}


# Where Linux says which ports it gives out as the local end of outgoing connections.
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# How far below the ephemeral range a picked port may lie.
_PICK_SPAN = 12000


def _ephemeral_floor() -> int:
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def unused_port() -> int:
    """A loopback port nothing is bound to, picked below the kernel's ephemeral range.

    The port is released before the program that is to listen on it binds it. A port from the
    ephemeral range (what binding port 0 gives) can meanwhile become the local end of any
    outgoing connection on the machine, and the program's bind then fails with "address
    already in use"; ports below that range are only ever taken by binding them by number."""
    floor = _ephemeral_floor()
    low = max(1024, floor - _PICK_SPAN)
    for _ in range(200):
        port = random.randrange(low, floor) if floor > low else 0
        if port and _bindable(port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))  # no room below the range: the kernel's pick
        return int(sock.getsockname()[1])


def with_free_port(good: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A slot that writes FREE_PORT gets one port of its own in its upstream and its command
    alike: the demo's stub cannot collide with a program on a fixed port (port_taken would
    then only refuse the load, and `make run` would serve nothing)."""
    command = good.get("command") or ()
    if FREE_PORT not in good["upstream"] and not any(FREE_PORT in arg for arg in command):
        return good
    key = (str(base_dir), good["name"], good["upstream"])
    if key not in _picked_ports:
        _picked_ports[key] = unused_port()
    port = str(_picked_ports[key])
    good["upstream"] = good["upstream"].replace(FREE_PORT, port)
    if command:
        good["command"] = tuple(arg.replace(FREE_PORT, port) for arg in command)
    return good
