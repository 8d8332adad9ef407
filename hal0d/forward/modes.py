"""How a slot serves a surface its upstream may or may not have: the Anthropic Messages API
(translated to chat completions, or relayed raw to the upstream's own /v1/messages: llama-server
and vLLM have one, with their own reasoning handling) and the OpenAI Responses API (relayed raw to
the upstream's own /v1/responses, or translated to chat completions for an upstream that has
none: llama-cpp-python, several remote providers, older vLLM).

`[[slots]] anthropic` and `[[slots]] responses` say which: "translate", "native", or "auto", for
which hal0d asks the upstream, on the first request of that surface that reaches the slot (under
its lease, so the upstream is up): a POST to the endpoint with an empty JSON object. Nothing is
generated. Only a definite answer decides:

    200, 400, 422, 500   native: the endpoint is there and took or refused the empty request
                         (vLLM refuses it 400; llama-server 500, its handler raising for the
                         missing field)
    404, 405, 501        translate: the server has no such endpoint
    anything else        nothing: a server loading its model (503), a rate limit (429), a key
                         refused (401, 403), no answer at all. That request is translated and
                         the next one asks again.

A choice is logged (`anthropic.mode_chosen`, `responses.mode_chosen`) and kept for the slot's
process: a new one (a restart, a reload's new command or upstream, the next load of an on-demand
slot) is asked again.
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
NO_ENDPOINT = frozenset({404, 405, 501})
# What a server with the endpoint answers an empty request.
HAS_ENDPOINT = frozenset({200, 400, 422, 500})
PROBE_TIMEOUT_S = 10.0
ANTHROPIC_VERSION = "2023-06-01"

# Which process a choice was made for: the slot's upstream and command, and the run of its
# process (Slot.generation, 0 for a slot hal0d does not run).
Process = tuple[str, tuple[str, ...] | None, int]


class EndpointModes:
    """Each "auto" slot's choice for one surface, asked of its process until it answers
    definitely (concurrent first requests share the one probe)."""

    surface: ClassVar[str]  # the SlotConfig field, and the log events' prefix
    path: ClassVar[str]
    headers: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self) -> None:
        self._chosen: dict[str, tuple[Process, str]] = {}
        self._asking: dict[str, asyncio.Lock] = {}

    async def mode(self, client: UpstreamClient, slot: SlotConfig, generation: int = 0) -> str:
        """The slot's mode; for "auto", the choice made for this run of its process
        (`generation`), asked now when there is none."""
        configured: str = getattr(slot, self.surface)
        if configured != AUTO:
            return configured
        process: Process = (slot.upstream, slot.command, generation)
        if (known := self._known(slot.name, process)) is not None:
            return known
        async with self._asking.setdefault(slot.name, asyncio.Lock()):
            if (known := self._known(slot.name, process)) is not None:
                return known
            choice = await self.probe(client, slot)
            if choice is None:
                return TRANSLATE
            self._chosen[slot.name] = (process, choice)
            return choice

    def _known(self, name: str, process: Process) -> str | None:
        kept = self._chosen.get(name)
        return kept[1] if kept is not None and kept[0] == process else None

    async def probe(self, client: UpstreamClient, slot: SlotConfig) -> str | None:
        """NATIVE or TRANSLATE from the upstream's answer to an empty request at the
        surface's endpoint; None when the answer decides nothing."""
        try:
            status, _ = await client.ask(
                slot, hdrs.METH_POST, self.path, body=b"{}", headers=dict(self.headers),
                during=f"waiting for POST {self.path}", timeout_s=PROBE_TIMEOUT_S,
            )
        except UpstreamUnavailable as exc:
            log.warning(f"{self.surface}.mode_probe_failed", slot=slot.name,
                        upstream=slot.upstream, error=str(exc), using=TRANSLATE)
            return None
        if status in NO_ENDPOINT:
            choice = TRANSLATE
        elif status in HAS_ENDPOINT:
            choice = NATIVE
        else:
            log.warning(f"{self.surface}.mode_undecided", slot=slot.name, probe_status=status,
                        using=TRANSLATE)
            return None
        log.info(f"{self.surface}.mode_chosen", slot=slot.name, mode=choice, probe_status=status)
        return choice


class AnthropicModes(EndpointModes):
    surface = "anthropic"
    path = "/v1/messages"
    headers = (("anthropic-version", ANTHROPIC_VERSION),)


class ResponsesModes(EndpointModes):
    surface = "responses"
    path = "/v1/responses"
