"""Every object the application shares, as a typed web.AppKey, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from hal0d.config import Config
from hal0d.lifecycle.slots import SlotTable
from hal0d.openai.owners import ResponseOwners
from hal0d.routing import Router

if TYPE_CHECKING:
    from hal0d.anthropic_mode import AnthropicModes
    from hal0d.events import EventHub
    from hal0d.lifecycle.manager import LifecycleManager
    from hal0d.metrics.recorder import Recorder
    from hal0d.stallguard import StallGuard
    from hal0d.tokens import TokenCounter


@dataclass(frozen=True, slots=True)
class Runtime:
    """The settings a request runs on. A reload swaps it whole; a request keeps the one it
    started with, so in-flight streams finish on the old settings."""

    config: Config
    router: Router

    @classmethod
    def build(cls, config: Config) -> Runtime:
        return cls(config, Router(config))


class RuntimeRef:
    """The application's current Runtime; a reload points it at a new one. (An aiohttp app's
    own mapping is frozen once it runs, so the swap happens inside this holder.)"""

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime


RUNTIME = web.AppKey("runtime", RuntimeRef)
SESSION = web.AppKey("session", aiohttp.ClientSession)
SLOTS = web.AppKey("slots", SlotTable)
# Every slot's lifecycle: its process, its probe, loads and unloads, reloads.
LIFECYCLE: web.AppKey[LifecycleManager] = web.AppKey("lifecycle")
# The stall guards of the streams being relayed now: a shutdown past its grace ends them.
STREAMS: web.AppKey[set[StallGuard]] = web.AppKey("streams")
RECORDER: web.AppKey[Recorder] = web.AppKey("recorder")
TOKEN_COUNTER: web.AppKey[TokenCounter] = web.AppKey("token_counter")
# The readers of GET /api/events.
EVENTS: web.AppKey[EventHub] = web.AppKey("events")
# Which model made each Responses API answer (bounded): GET/DELETE /v1/responses/{id} go there.
RESPONSE_OWNERS = web.AppKey("response_owners", ResponseOwners)
# Each `anthropic = "auto"` slot's choice, asked of its upstream once.
ANTHROPIC_MODES: web.AppKey[AnthropicModes] = web.AppKey("anthropic_modes")
