"""The listening sockets: [server]'s and the Ollama listener's, taken before anything else starts
(a port another process holds fails before any slot process is started for nothing), and what
the operator can do when one cannot be had (`server.bind_failed`'s hint)."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from hal0d import logs
from hal0d.config import Config

log = logs.get_logger()

SOMAXCONN = Path("/proc/sys/net/core/somaxconn")


def listen(host: str, port: int, backlog: int) -> list[socket.socket]:
    """The listening sockets of `host` (every address it names, as aiohttp's TCPSite would bind
    them), taken before anything else starts: a port another process holds fails here, before
    any slot process is started for nothing. Connections that come meanwhile wait in the
    backlog until the site serves them."""
    addresses = dict.fromkeys(
        (family, address) for family, _, _, _, address in socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    taken: list[socket.socket] = []
    try:
        for family, address in addresses:
            sock = socket.socket(family, socket.SOCK_STREAM)
            taken.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
            sock.listen(backlog)
            sock.setblocking(False)
    except OSError:
        close_all(taken)
        raise
    return taken


def take_sockets(config: Config, backlog: int) -> list[socket.socket] | None:
    """The listening sockets of [server] and, when set, of [ollama] listen; None (and the
    reason logged, `server.bind_failed`) when one cannot be had."""
    try:
        sockets = listen(config.server.host, config.server.port, backlog)
    except OSError as exc:
        log.error("server.bind_failed", host=config.server.host, port=config.server.port,
                  error=exc.strerror or str(exc), hint=bind_hint(exc))
        return None
    if (ollama := config.ollama.address) is not None:
        try:
            sockets += listen(*ollama, backlog)
        except OSError as exc:
            close_all(sockets)
            log.error("server.bind_failed", host=ollama[0], port=ollama[1], listener="ollama",
                      error=exc.strerror or str(exc), hint=OLLAMA_BIND_HINT)
            return None
    return sockets


def close_all(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


def bind_hint(exc: OSError, environ: Mapping[str, str] = os.environ) -> str:
    """What the operator can do about a listening address that cannot be had: under make (its
    recipes have MAKELEVEL set: `make run`), make's HOST= and PORT=; else the flags."""
    make = "MAKELEVEL" in environ
    host, port = ("make run HOST=...", "make run PORT=...") if make else ("--host", "--port")
    if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
        return (f"no interface of this machine has that address; choose another with {host} "
                "or [server].host")
    if exc.errno == errno.EADDRINUSE:
        return f"another process listens there; choose another port with {port} or [server].port"
    if exc.errno == errno.EACCES:
        return ("ports below 1024 need privileges (CAP_NET_BIND_SERVICE); choose another port "
                f"with {port} or [server].port")
    both = "make run HOST=... PORT=..." if make else "--host/--port"
    return f"check {both} or [server].host and .port"


OLLAMA_BIND_HINT = ("the Ollama listener's address cannot be had (another process, an Ollama "
                    "itself, may listen there); choose another in [ollama].listen")


def somaxconn() -> int | None:
    """The kernel's ceiling on a listen backlog (net.core.somaxconn), None where unreadable."""
    try:
        return int(SOMAXCONN.read_text())
    except (OSError, ValueError):
        return None
