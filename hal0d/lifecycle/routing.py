"""Routing: which slot serves a requested model name, aliases (glob patterns) applied first, and
the Runtime (the settings, the router and the keys) a request runs on."""

from __future__ import annotations

from dataclasses import dataclass

from hal0d.config import Config, SlotConfig, alias_target
from hal0d.errors import NoRoute
from hal0d.keys import KeyRing


@dataclass(frozen=True, slots=True)
class Route:
    slot: SlotConfig
    served_model: str  # the name the upstream knows; the client's name may be an alias


class Router:
    def __init__(self, config: Config) -> None:
        self._by_model = {model: slot for slot in config.slots for model in slot.models}
        self._aliases = config.models

    def served_models(self) -> list[str]:
        return sorted(self._by_model)

    def resolve(self, model: str) -> Route:
        served = model if model in self._by_model else alias_target(self._aliases, model)
        slot = self._by_model.get(served) if served is not None else None
        if slot is None or served is None:
            raise NoRoute(
                f"no slot serves model {model!r}; served models: "
                + (", ".join(self.served_models()) or "none"),
                field="model",
            )
        return Route(slot, served)


@dataclass(frozen=True, slots=True)
class Runtime:
    """The settings a request runs on. A reload swaps it whole; a request keeps the one it
    started with, so in-flight streams finish on the old settings."""

    config: Config
    router: Router
    keys: KeyRing

    @classmethod
    def build(cls, config: Config) -> Runtime:
        return cls(config, Router(config), KeyRing(config))


class RuntimeRef:
    """The application's current Runtime; a reload points it at a new one. (An aiohttp app's
    own mapping is frozen once it runs, so the swap happens inside this holder.)"""

    def __init__(self, runtime: Runtime) -> None:
        self.current = runtime
