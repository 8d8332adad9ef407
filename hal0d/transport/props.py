"""What a slot's server says of itself: llama.cpp's llama-server answers GET /props with its
model, its context, its chat template and what that template can do (`chat_template_caps`), and
what its model takes besides text (`modalities`).

Asked of an upstream that is up, once per run of its process (the process, as forward/modes.py
keys its choices: the slot's upstream, its command, Slot.generation): a restart or a reload's
new command may serve another model. A server without the endpoint (404: vLLM, a remote
provider, another hal0d) is remembered as saying nothing, for that process; no answer at all
(a timeout, a refused connect) is asked again after PROPS_RETRY_S, not by every model list
meanwhile (Open WebUI reads /api/tags and /api/ps every few seconds). Nothing is generated.
While the slot is not up (an on-demand slot unloaded), or its process gives no answer, its last
process's answer stands for the next one of the same upstream and command (`last`): what a model
list says of it does not flip with every load.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

PROPS_PATH = "/props"
# A model list waits at most this for a server's self-description (it is read from memory).
PROPS_TIMEOUT_S = 2.0
# A server that gave no answer at all is asked again after this.
PROPS_RETRY_S = 60.0

Process = tuple[str, tuple[str, ...] | None, int]


class UpstreamProps:
    """Each slot's last answer to GET /props, for the run of its process it came from."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[Process, dict[str, Any] | None]] = {}
        # The process that gave no answer at all, and the monotonic time it is asked again.
        self._unanswered: dict[str, tuple[Process, float]] = {}
        self._asking: dict[str, asyncio.Lock] = {}

    async def of(self, client: UpstreamClient, slot: SlotConfig,
                 generation: int) -> dict[str, Any] | None:
        """The slot's /props for this run of its process, asked now when not known; None when
        the server says nothing of itself."""
        process: Process = (slot.upstream, slot.command, generation)
        kept = self._known.get(slot.name)
        if kept is not None and kept[0] == process:
            return kept[1]
        async with self._asking.setdefault(slot.name, asyncio.Lock()):
            kept = self._known.get(slot.name)
            if kept is not None and kept[0] == process:
                return kept[1]
            silent = self._unanswered.get(slot.name)
            if silent is not None and silent[0] == process and time.monotonic() < silent[1]:
                return self.last(slot)
            try:
                props = await self._ask(client, slot)
            except UpstreamUnavailable as exc:
                log.debug("upstream.props_unanswered", slot=slot.name, cause=str(exc))
                self._unanswered[slot.name] = (process, time.monotonic() + PROPS_RETRY_S)
                return self.last(slot)
            self._known[slot.name] = (process, props)
            self._unanswered.pop(slot.name, None)
            return props

    def last(self, slot: SlotConfig) -> dict[str, Any] | None:
        """The answer of the slot's last process of the same upstream and command (any run),
        for a slot that is not up; None when none answered."""
        kept = self._known.get(slot.name)
        if kept is None or kept[0][:2] != (slot.upstream, slot.command):
            return None
        return kept[1]

    @staticmethod
    async def _ask(client: UpstreamClient, slot: SlotConfig) -> dict[str, Any] | None:
        status, body = await client.ask(slot, hdrs.METH_GET, PROPS_PATH,
                                        during=f"waiting for GET {PROPS_PATH}",
                                        timeout_s=PROPS_TIMEOUT_S)
        if status != 200:
            return None
        try:
            props = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(props, dict):
            return None
        log.debug("upstream.props_read", slot=slot.name, model=props.get("model_alias"))
        return props
