"""What a slot's server says of itself: llama.cpp's llama-server answers GET /props with its
model, its context, its chat template and what that template can do (`chat_template_caps`), and
what its model takes besides text (`modalities`). Only what the model lists read of it is kept
(capabilities.essentials), and the answer is read within the bound of every answer hal0d reads
for itself (upstream.OWN_ANSWER_LIMIT): a server that says more is treated as one that gave no
answer.

Asked of an upstream that is up, once per run of its process (the process, as forward/modes.py
keys its choices: the slot's upstream, its command, Slot.generation): a restart or a reload's
new command may serve another model. For a slot without a command, the lifecycle counts a new
run each time its probe sees the server come back after it was down. A server hal0d runs that
answers without a description (404: an older llama-server) is remembered as saying nothing,
for that process. A failure is asked again after a pause that doubles from PROPS_RETRY_FIRST_S
to PROPS_RETRY_MAX_S, not by every model list meanwhile (Open WebUI reads /api/tags and /api/ps
every few seconds): no answer at all (a timeout, a refused connect, an answer over the bound),
and, for a slot without a command, an answer without a description too: hal0d does not know
what runs there, and a server started there later (or the same one, once it has loaded) may
say more. Nothing is generated. While the slot is not up (an on-demand slot unloaded), or its
process gives no answer, its last process's answer stands for the next one of the same upstream
and command (`last`): what a model list says of it does not flip with every load.
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
from hal0d.ollama.capabilities import essentials
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

PROPS_PATH = "/props"
MODELS_PATH = "/v1/models"  # where vLLM, which has no /props, says max_model_len
# A model list waits at most this for a server's self-description (it is read from memory).
PROPS_TIMEOUT_S = 2.0
# A failed ask is asked again after this, the pause doubling with each failure of the same
# process up to PROPS_RETRY_MAX_S.
PROPS_RETRY_FIRST_S = 5.0
PROPS_RETRY_MAX_S = 300.0

Process = tuple[str, tuple[str, ...] | None, int]


class UpstreamProps:
    """Each slot's last answer to GET /props, for the run of its process it came from."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[Process, dict[str, Any] | None]] = {}
        # The process whose ask failed: the monotonic time it is asked again, and the pause
        # that led there (the next failure's is twice as long).
        self._retry: dict[str, tuple[Process, float, float]] = {}
        self._asking: dict[str, asyncio.Lock] = {}

    async def of(self, client: UpstreamClient, slot: SlotConfig,
                 generation: int) -> dict[str, Any] | None:
        """The slot's /props for this run of its process, asked now when not known (or when
        a failed ask's pause has passed); None when the server says nothing of itself."""
        process: Process = (slot.upstream, slot.command, generation)
        if (held := self._held(slot, process)) is not None:
            return held[0]
        async with self._asking.setdefault(slot.name, asyncio.Lock()):
            if (held := self._held(slot, process)) is not None:
                return held[0]
            try:
                props = await self._ask(client, slot)
            except UpstreamUnavailable as exc:
                pause = self._failed(slot.name, process)
                log.debug("upstream.props_unanswered", slot=slot.name, cause=str(exc),
                          retry_s=pause)
                return self.last(slot)
            if props is None and not slot.command:
                self._failed(slot.name, process)
            else:
                self._retry.pop(slot.name, None)
            self._known[slot.name] = (process, props)
            return props

    def _held(self, slot: SlotConfig, process: Process
              ) -> tuple[dict[str, Any] | None] | None:
        """What stands for `process` without asking, in a 1-tuple (its answer may be None);
        None when it is to be asked now."""
        retry = self._retry.get(slot.name)
        if retry is not None and retry[0] == process:
            if time.monotonic() >= retry[1]:
                return None
            return (self.last(slot),)
        kept = self._known.get(slot.name)
        return (kept[1],) if kept is not None and kept[0] == process else None

    def _failed(self, name: str, process: Process) -> float:
        """The process is asked again after a pause, twice the last one's for the same process
        (from PROPS_RETRY_FIRST_S, up to PROPS_RETRY_MAX_S); returns the pause."""
        retry = self._retry.get(name)
        pause = (min(retry[2] * 2, PROPS_RETRY_MAX_S) if retry is not None
                 and retry[0] == process else PROPS_RETRY_FIRST_S)
        self._retry[name] = (process, time.monotonic() + pause, pause)
        return pause

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
        if status == 404:  # vLLM has no /props: its model list says its context
            return await _max_model_len(client, slot)
        if status != 200:
            return None
        props = _json_object(body)
        if props is None:
            return None
        log.debug("upstream.props_read", slot=slot.name, model=props.get("model_alias"))
        return essentials(props)


async def _max_model_len(client: UpstreamClient, slot: SlotConfig) -> dict[str, Any] | None:
    """{"max_model_len": N} from a vLLM model list's first entry that has one; None when the
    list says none."""
    status, body = await client.ask(slot, hdrs.METH_GET, MODELS_PATH,
                                    during=f"waiting for GET {MODELS_PATH}",
                                    timeout_s=PROPS_TIMEOUT_S)
    listed = _json_object(body) if status == 200 else None
    entries = listed.get("data") if listed is not None else None
    for entry in entries if isinstance(entries, list) else ():
        length = entry.get("max_model_len") if isinstance(entry, dict) else None
        if type(length) is int and length > 0:
            return {"max_model_len": length}
    return None


def _json_object(body: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None
