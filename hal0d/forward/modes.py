"""How a slot serves a surface its upstream may or may not have: the Anthropic Messages API
(translated to chat completions, or relayed raw to the upstream's own /v1/messages: llama-server
and vLLM have one, with their own reasoning handling) and the OpenAI Responses API (relayed raw to
the upstream's own /v1/responses, or translated to chat completions for an upstream that has
none: llama-cpp-python, several remote providers, older vLLM).

`[[slots]] anthropic` and `[[slots]] responses` say which: "translate", "native", or "auto", for
which hal0d asks the upstream once, on the first request of that surface that reaches the slot
(under its lease, so the upstream is up): a POST to the endpoint with an empty JSON object, which
a server with the endpoint refuses as a bad request (400, 422) and a server without it answers
404 or 405. Nothing is generated. The choice is logged (`anthropic.mode_chosen`,
`responses.mode_chosen`) and kept for the slot's upstream address; a probe that gets no answer at
all decides nothing, and the request is translated.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

TRANSLATE, NATIVE, AUTO = "translate", "native", "auto"
# What a server without the endpoint answers a POST to it.
NO_ENDPOINT = frozenset({404, 405})
PROBE_TIMEOUT_S = 10.0
ANTHROPIC_VERSION = "2023-06-01"


class EndpointModes:
    """Each "auto" slot's choice for one surface, asked of its upstream once (concurrent first
    requests share the one probe)."""

    surface: ClassVar[str]  # the SlotConfig field, and the log events' prefix
    path: ClassVar[str]
    headers: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self) -> None:
        self._chosen: dict[tuple[str, str], str] = {}
        self._asking: dict[tuple[str, str], asyncio.Lock] = {}

    async def mode(self, client: UpstreamClient, slot: SlotConfig) -> str:
        configured: str = getattr(slot, self.surface)
        if configured != AUTO:
            return configured
        key = (slot.name, slot.upstream)
        if key in self._chosen:
            return self._chosen[key]
        async with self._asking.setdefault(key, asyncio.Lock()):
            if key not in self._chosen:
                choice = await self.probe(client, slot)
                if choice is None:
                    return TRANSLATE
                self._chosen[key] = choice
            return self._chosen[key]

    async def probe(self, client: UpstreamClient, slot: SlotConfig) -> str | None:
        """NATIVE or TRANSLATE from the upstream's answer to an empty request at the
        surface's endpoint; None when it did not answer."""
        try:
            status, _ = await client.ask(
                slot, hdrs.METH_POST, self.path, body=b"{}", headers=dict(self.headers),
                during=f"waiting for POST {self.path}", timeout_s=PROBE_TIMEOUT_S,
            )
        except UpstreamUnavailable as exc:
            log.warning(f"{self.surface}.mode_probe_failed", slot=slot.name, error=str(exc),
                        using=TRANSLATE)
            return None
        choice = TRANSLATE if status in NO_ENDPOINT else NATIVE
        log.info(f"{self.surface}.mode_chosen", slot=slot.name, mode=choice, probe_status=status)
        return choice


class AnthropicModes(EndpointModes):
    surface = "anthropic"
    path = "/v1/messages"
    headers = (("anthropic-version", ANTHROPIC_VERSION),)


class ResponsesModes(EndpointModes):
    surface = "responses"
    path = "/v1/responses"
