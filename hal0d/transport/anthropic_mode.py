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

from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

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

    async def mode(self, client: UpstreamClient, slot: SlotConfig) -> str:
        if slot.anthropic != AUTO:
            return slot.anthropic
        key = (slot.name, slot.upstream)
        if key in self._chosen:
            return self._chosen[key]
        async with self._asking.setdefault(key, asyncio.Lock()):
            if key not in self._chosen:
                choice = await probe(client, slot)
                if choice is None:
                    return TRANSLATE
                self._chosen[key] = choice
            return self._chosen[key]


async def probe(client: UpstreamClient, slot: SlotConfig) -> str | None:
    """NATIVE or TRANSLATE from the upstream's answer to an empty Messages request; None when
    it did not answer."""
    try:
        status, _ = await client.ask(
            slot, hdrs.METH_POST, "/v1/messages", body=b"{}",
            headers={"anthropic-version": ANTHROPIC_VERSION},
            during="waiting for POST /v1/messages", timeout_s=PROBE_TIMEOUT_S,
        )
    except UpstreamUnavailable as exc:
        log.warning("anthropic.mode_probe_failed", slot=slot.name, error=str(exc),
                    using=TRANSLATE)
        return None
    choice = TRANSLATE if status in NO_ENDPOINT else NATIVE
    log.info("anthropic.mode_chosen", slot=slot.name, mode=choice, probe_status=status)
    return choice
