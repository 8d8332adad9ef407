"""Slots whose upstream is another hal0d (`kind = "hal0d"`): which of its models are loaded there.

A route with prefer_loaded tries the slots that answer without a load first (forward.Dispatch.
order); for a second box that is itself a hal0d, that is whether the model is loaded *there*. So
for each such slot one task reads the other hal0d's `/v1/models` (its `state` per model) and then
follows its `/api/events`, reading the models again whenever a slot there changes state (the
feed's `hello` and `slot` events). A slot's key is presented as for any request (`api_key`); it
needs the `read` and `inference` scopes there. What cannot be read is unknown, and an unknown
model counts as not loaded: a box that cannot be asked is not preferred.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import Iterable
from typing import Final

import orjson
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamInvalid, UpstreamUnavailable
from hal0d.logs import get_logger
from hal0d.protocol.sse import Decoder
from hal0d.transport.upstream import BODY_BROKEN, OWN_ANSWER_LIMIT, UpstreamClient

log = get_logger()

KIND_HAL0D: Final = "hal0d"
READ_TIMEOUT_S: Final = 5.0
# A feed that ended or failed is asked for again after this.
RETRY_S: Final = 2.0
# hal0d's feed sends a heartbeat every 15 s: a feed silent for longer is gone.
FEED_SILENCE_S: Final = 45.0
# A feed or an answer that broke, stalled or was not JSON.
_UNREADABLE: Final[tuple[type[Exception], ...]] = (*BODY_BROKEN, TimeoutError, ValueError)
# The events after which the other hal0d's models may have changed state.
_CHANGES: Final = frozenset({"hello", "slot"})


class RemoteModels:
    """The model states other hal0d boxes report, per slot; one follower task per such slot."""

    def __init__(self, client: UpstreamClient) -> None:
        self._client = client
        self._states: dict[str, dict[str, str]] = {}
        self._followers: dict[str, tuple[SlotConfig, asyncio.Task[None]]] = {}

    def state(self, slot: str, model: str) -> str | None:
        """The state the other hal0d last reported for `model`, None when unknown."""
        return self._states.get(slot, {}).get(model)

    def watch(self, slots: Iterable[SlotConfig]) -> None:
        """Follow exactly the hal0d-kind slots of `slots` (at start and after each reload)."""
        wanted = {slot.name: slot for slot in slots if slot.kind == KIND_HAL0D}
        for name, (config, task) in list(self._followers.items()):
            if wanted.get(name) != config:
                task.cancel()
                del self._followers[name]
                self._states.pop(name, None)
        for name, config in wanted.items():
            if name not in self._followers:
                # A context of its own: a reload's request id is not the follower's.
                task = asyncio.create_task(self._follow(config), name=f"remote-{name}",
                                           context=contextvars.Context())
                self._followers[name] = (config, task)

    async def close(self) -> None:
        tasks = [task for _, task in self._followers.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._followers.clear()

    async def _follow(self, slot: SlotConfig) -> None:
        reported: str | None = None
        while True:
            try:
                await self._read_models(slot)
                await self._read_feed(slot)
                why = "the event feed ended"
            except UpstreamUnavailable as exc:
                why = exc.cause or str(exc)
            except _UNREADABLE as exc:
                why = f"{type(exc).__name__} reading its state"
            self._states.pop(slot.name, None)
            if why != reported:
                log.info("slot.remote_state_unknown", slot=slot.name, reason=why,
                         retry_s=RETRY_S)
                reported = why
            await asyncio.sleep(RETRY_S)

    async def _read_models(self, slot: SlotConfig) -> None:
        status, body = await self._client.ask(
            slot, hdrs.METH_GET, "/v1/models", during="waiting for GET /v1/models",
            timeout_s=READ_TIMEOUT_S)
        if status != 200:
            raise UpstreamUnavailable(f"GET /v1/models answered {status}")
        listed = orjson.loads(body).get("data", [])
        self._states[slot.name] = {
            str(model["id"]): str(model.get("state", "ready"))
            for model in listed if isinstance(model, dict) and "id" in model
        }

    async def _read_feed(self, slot: SlotConfig) -> None:
        feed = await self._client.listen(slot, "/api/events", connect_timeout_s=READ_TIMEOUT_S)
        try:
            if feed.status != 200:
                raise UpstreamUnavailable(f"GET /api/events answered {feed.status}")
            decoder = Decoder()
            # What was read since the last whole event or comment: the decoder holds it.
            pending = 0
            while True:
                async with asyncio.timeout(FEED_SILENCE_S):
                    chunk = await feed.content.readany()
                if not chunk:
                    return
                events = decoder.feed(chunk)
                pending = 0 if events or decoder.comments else pending + len(chunk)
                if pending > OWN_ANSWER_LIMIT:
                    # An event that never ends would be held whole: refused like any answer
                    # over the bound, and the feed is asked for again.
                    log.warning("upstream.answer_too_large", slot=slot.name,
                                path="/api/events", limit_bytes=OWN_ANSWER_LIMIT)
                    raise UpstreamInvalid(f"an event of /api/events over {OWN_ANSWER_LIMIT} "
                                          "bytes")
                if any(event.event in _CHANGES for event in events):
                    await self._read_models(slot)
        finally:
            with contextlib.suppress(Exception):
                feed.close()
