"""The health probe: does a slot's upstream answer GET /v1/models?

The lifecycle manager probes every slot that is up periodically, and each new process until it
answers (or exits, or runs out of its load's time).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import socket
import time
from urllib.parse import urlsplit

from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.lifecycle.process import Child
from hal0d.transport.upstream import UpstreamClient

PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 0.2
# A starting process is asked FIRST_POLL_S after it starts, then every FAST_POLL_S for its first
# FAST_PHASE_S, then every STARTUP_POLL_S: a model that is up in 80 ms is served within 25 ms of
# listening, not at the next tick of an interval that grew (an interval doubling from 10 ms
# waited from 70 ms to 150 ms for a server up at 86 ms: most of hal0d's own cost of a load on
# a slower day), and a slow one (a real model loads for seconds) costs a refused connect every
# 200 ms after its first 2 s, as before.
FIRST_POLL_S = 0.01
FAST_POLL_S = 0.025
FAST_PHASE_S = 2.0


async def probe(client: UpstreamClient, config: SlotConfig) -> str | None:
    """None when the upstream answers GET /v1/models, else why not."""
    try:
        # The status is the answer: the list itself is not read (a remote provider's is long).
        status, _ = await client.ask(config, hdrs.METH_GET, "/v1/models",
                                     during="waiting for GET /v1/models",
                                     timeout_s=PROBE_TIMEOUT_S, limit=0)
    except UpstreamUnavailable as exc:
        # A reason, not an error: no request is waiting on the probe. A probe short of a
        # descriptor is not counted as a refused request either (no refused_at).
        return exc.cause or str(exc)
    if status >= 500:
        return f"GET /v1/models answered {status}"
    return None


def port_taken(upstream: str) -> str | None:
    """Why a process started for `upstream` could not have it to itself: something already
    listens on its port (another program, an earlier hal0d's process): None when the port is
    free or not this machine's to check. A probe would otherwise take that other program's
    answer for the new process's. A bind with SO_REUSEADDR fails only on a listener, not on
    connections an earlier process left in TIME_WAIT."""
    parts = urlsplit(upstream)
    host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    if host is None:
        return None
    try:
        address = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host)
    except ValueError:
        return None  # a name: a remote provider, or one this check cannot place
    if not address.is_loopback:
        return None
    family = socket.AF_INET6 if address.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((str(address), port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return (f"{host}:{port} is already in use by another process: the slot's "
                        "command could not listen there")
    return None


async def answers_within(client: UpstreamClient, config: SlotConfig, timeout_s: float) -> bool:
    """Probes until the upstream answers (True) or `timeout_s` has passed (False)."""
    started = time.monotonic()
    deadline = started + timeout_s
    pause = FIRST_POLL_S
    while time.monotonic() < deadline:
        if await probe(client, config) is None:
            return True
        await asyncio.sleep(pause)
        pause = FAST_POLL_S if time.monotonic() - started < FAST_PHASE_S else STARTUP_POLL_S
    return False


async def until_answering(client: UpstreamClient, config: SlotConfig, child: Child,
                          timeout_s: float) -> str | None:
    """None once a new process answers its probe; else why it never will (it exited, or it
    did not answer within `timeout_s`)."""
    answering = asyncio.create_task(answers_within(client, config, timeout_s))
    exited = asyncio.create_task(child.wait())
    try:
        await asyncio.wait({answering, exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        answering.cancel()
        exited.cancel()
    if exited.done() and not exited.cancelled():
        return child.exit_summary(exited.result())
    if answering.done() and not answering.cancelled() and answering.result():
        return None
    return f"not answering within load_timeout_s = {config.load_timeout_s:g} s"
