"""How a slot serves the Anthropic Messages API: translated to chat completions, or relayed raw to
the upstream's own /v1/messages (llama-server and vLLM have one, with their own reasoning handling).

`[[slots]] anthropic` says which: "translate", "native", or "auto", for which hal0d asks the
upstream once, on the first Anthropic request that reaches the slot (under its lease, so the
upstream is up): a POST /v1/messages with an empty body, which a server with the endpoint refuses
as a bad request (400, 422) and a server without it answers 404 or 405. Nothing is generated. The
choice is logged (`anthropic.mode_chosen`) and kept for the slot's upstream address; a probe that
gets no answer at all decides nothing, and the request is translated.
"""

from __future__ import annotations

import asyncio

import aiohttp
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.logs import get_logger
from hal0d.upstream import TRANSPORT_ERRORS, own_headers

log = get_logger()

TRANSLATE, NATIVE, AUTO = "translate", "native", "auto"
# What a server without a Messages endpoint answers a POST to it.
NO_ENDPOINT = frozenset({404, 405})
PROBE_TIMEOUT_S = 10.0
ANTHROPIC_VERSION = "2023-06-01"


class AnthropicModes:
    """Each "auto" slot's choice, asked of its upstream once (concurrent first requests share
    the one probe)."""

    def __init__(self) -> None:
        self._chosen: dict[tuple[str, str], str] = {}
        self._asking: dict[tuple[str, str], asyncio.Lock] = {}

    async def mode(self, session: aiohttp.ClientSession, slot: SlotConfig) -> str:
        if slot.anthropic != AUTO:
            return slot.anthropic
        key = (slot.name, slot.upstream)
        if key in self._chosen:
            return self._chosen[key]
        async with self._asking.setdefault(key, asyncio.Lock()):
            if key not in self._chosen:
                choice = await probe(session, slot)
                if choice is None:
                    return TRANSLATE
                self._chosen[key] = choice
            return self._chosen[key]


async def probe(session: aiohttp.ClientSession, slot: SlotConfig) -> str | None:
    """NATIVE or TRANSLATE from the upstream's answer to an empty Messages request; None when
    it did not answer."""
    headers = own_headers(slot)
    headers[hdrs.CONTENT_TYPE] = "application/json"
    headers["anthropic-version"] = ANTHROPIC_VERSION
    try:
        async with session.post(
            slot.upstream + "/v1/messages", data=b"{}", headers=headers,
            timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S),
        ) as answer:
            status = answer.status
            await answer.read()
    except TRANSPORT_ERRORS as exc:
        log.warning("anthropic.mode_probe_failed", slot=slot.name, error=repr(exc),
                    using=TRANSLATE)
        return None
    choice = TRANSLATE if status in NO_ENDPOINT else NATIVE
    log.info("anthropic.mode_chosen", slot=slot.name, mode=choice, probe_status=status)
    return choice
