"""Every object the application shares, as a typed web.AppKey, in one place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from hal0d.config import Config
from hal0d.routing import Router
from hal0d.slots import SlotTable

if TYPE_CHECKING:
    from hal0d.supervisor import Supervisor


@dataclass(frozen=True, slots=True)
class Runtime:
    """The settings a request runs on. A reload swaps it whole; a request keeps the one it
    started with, so in-flight streams finish on the old settings."""

    config: Config
    router: Router

    @classmethod
    def build(cls, config: Config) -> Runtime:
        return cls(config, Router(config))


RUNTIME = web.AppKey("runtime", Runtime)
SESSION = web.AppKey("session", aiohttp.ClientSession)
SLOTS = web.AppKey("slots", SlotTable)
SUPERVISOR: web.AppKey[Supervisor] = web.AppKey("supervisor")
