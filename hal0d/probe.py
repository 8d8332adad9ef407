"""The health probe: does a slot's upstream answer GET /v1/models?

The supervisor probes every slot periodically and each starting process until it answers; the
loader probes an on-demand slot's new process the same way.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from hal0d.config import SlotConfig
from hal0d.upstream import TRANSPORT_ERRORS, own_headers, transport_reason

PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 0.2
# A starting process is asked this soon after it starts, then at twice the interval each time up
# to STARTUP_POLL_S: a model that is up in 30 ms is served then, not at the next 200 ms tick
# (which was most of hal0d's own cost of a swap), and a slow one costs a refused connect
# every 200 ms, as before.
FIRST_POLL_S = 0.01


async def probe(session: aiohttp.ClientSession, config: SlotConfig) -> str | None:
    """None when the upstream answers GET /v1/models, else why not."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with session.get(
                config.upstream + "/v1/models", headers=own_headers(config)
            ) as resp:
                await resp.read()
                if resp.status >= 500:
                    return f"GET /v1/models answered {resp.status}"
                return None
    except TRANSPORT_ERRORS as exc:
        # A reason, not an error: no request is waiting on the probe. A probe short of a
        # descriptor is not counted as a refused request either.
        return transport_reason(exc, "waiting for GET /v1/models")


async def answers_within(
    session: aiohttp.ClientSession, config: SlotConfig, timeout_s: float
) -> bool:
    """Probes until the upstream answers (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    pause = FIRST_POLL_S
    while time.monotonic() < deadline:
        if await probe(session, config) is None:
            return True
        await asyncio.sleep(pause)
        pause = min(pause * 2, STARTUP_POLL_S)
    return False
