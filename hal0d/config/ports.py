"""`{free_port}` in a slot: a free loopback port picked for it, and the same one again on reload.

The demo's stub must not collide with whatever else runs on the machine, so its config names no
port and hal0d picks one. The pick is remembered for the life of the process (this module's one
piece of state): a reload that reads the same slot again must name the same port, or the
unchanged slot would look changed and be restarted.
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

# Written in a slot's `upstream` and `command`: a free loopback port hal0d picks for that slot.
FREE_PORT = "{free_port}"
# The port picked per (config folder, slot name, upstream as written), kept for the process's
# life: a reload of an unchanged slot names the same port (the slot is not restarted).
_picked_ports: dict[tuple[str, str, str], int] = {}


def _unused_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
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
        _picked_ports[key] = _unused_port()
    port = str(_picked_ports[key])
    good["upstream"] = good["upstream"].replace(FREE_PORT, port)
    if command:
        good["command"] = tuple(arg.replace(FREE_PORT, port) for arg in command)
    return good
