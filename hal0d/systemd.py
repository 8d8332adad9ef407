"""sd_notify and the watchdog interval: the notify socket protocol, no dependencies."""

from __future__ import annotations

import os
import socket


def notify(*fields: str) -> bool:
    """Send `READY=1`, `STATUS=...` and friends to systemd; False when not run by systemd."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # an abstract socket
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.connect(address)
            sock.sendall("\n".join(fields).encode())
    except OSError:
        return False
    return True


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds, when systemd asked this very process for pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return int(usec) / 1_000_000 / 2
    except ValueError:
        return None
