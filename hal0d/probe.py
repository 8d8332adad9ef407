"""The health probe: does a slot's upstream answer GET /v1/models?

The supervisor probes every slot periodically and each starting process until it answers; the
loader probes an on-demand slot's new process the same way.
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
from aiohttp import hdrs

from hal0d import USER_AGENT
from hal0d.config import SlotConfig

PROBE_TIMEOUT_S = 5.0
STARTUP_POLL_S = 0.2


async def probe(session: aiohttp.ClientSession, config: SlotConfig) -> str | None:
    """None when the upstream answers GET /v1/models, else why not."""
    headers: dict[str, str] = {hdrs.USER_AGENT: USER_AGENT}
    token = config.bearer_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            async with session.get(config.upstream + "/v1/models", headers=headers) as resp:
                await resp.read()
                if resp.status >= 500:
                    return f"GET /v1/models answered {resp.status}"
                return None
    except TimeoutError:
        return f"GET /v1/models timed out after {PROBE_TIMEOUT_S:g} s"
    except aiohttp.ClientConnectorError as exc:
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    except (aiohttp.ClientError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"


async def answers_within(
    session: aiohttp.ClientSession, config: SlotConfig, timeout_s: float
) -> bool:
    """Probes until the upstream answers (True) or `timeout_s` has passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await probe(session, config) is None:
            return True
        await asyncio.sleep(STARTUP_POLL_S)
    return False
