"""sd_notify and the watchdog interval: the notify socket protocol, no dependencies.

The messages hal0d sends, and when (see server.py):

    READY=1            listening, and every slot without a command answered its first probe
    STATUS=...         the port and the slot states, refreshed while running
    WATCHDOG=1         from the event loop at half of WATCHDOG_USEC; a blocked loop stops them
    RELOADING=1        a SIGHUP reload started (with MONOTONIC_USEC, as Type=notify-reload wants)
    STOPPING=1         a SIGTERM/SIGINT drain started
"""

from __future__ import annotations

import os
import socket
import time


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


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: systemd matches RELOADING=1 to the reload it asked for
    by this timestamp (Type=notify-reload); under Type=notify it is accepted and ignored."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


def reloading(status: str) -> bool:
    return notify("RELOADING=1", f"MONOTONIC_USEC={monotonic_usec()}", "STATUS=" + status)


def ready(status: str) -> bool:
    return notify("READY=1", "STATUS=" + status)


def stopping(status: str) -> bool:
    return notify("STOPPING=1", "STATUS=" + status)


def status(text: str) -> bool:
    return notify("STATUS=" + text)


def watchdog_interval() -> float | None:
    """Half of WATCHDOG_USEC in seconds, when systemd asked this very process for pings."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 1_000_000 / 2 if value > 0 else None
