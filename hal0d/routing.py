"""Routing: which slots serve a requested model name, aliases (glob patterns) applied first, and
the Runtime (the settings, the router and the keys) a request runs on.

A model a slot lists is served by that slot alone. A `[[routes]]` model is served by its slots in
their order (each asked for its `served` name), so the forward path can hand a request on to the
next while nothing has reached the client; the order is the plan, and with `prefer_loaded` the
slots that have their model loaded go first (hal0d/forward/placement.py orders them).

Ollama treats `x` and `x:latest` as one name, and its clients' configurations carry the tag: a
name ending in `:latest` that no slot, route or exact alias names as it is is served as the
name without the tag, on every surface (before the glob aliases: a catch-all `"*"` does not take
`x:latest` from a served `x`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from hal0d.config import Config, RouteConfig, SlotConfig, alias_target
from hal0d.errors import NoRoute
from hal0d.keys import Key, KeyRing

# Ollama's default tag: `x:latest` is `x` (see the module's docstring).
LATEST: Final = ":latest"
# How near each state is to answering, nearest first (ready and serving alike): a route is shown
# in its best slot's state. A state not listed (a remote's word hal0d does not use) comes last.
READINESS: Final = {"ready": 0, "serving": 0, "starting": 1, "stopped": 2, "stopping": 3,
                    "error": 4, "offline": 5}


@dataclass(frozen=True, slots=True)
class Route:
    slot: SlotConfig
    served_model: str  # the name the upstream knows; the client's name may be an alias


@dataclass(frozen=True, slots=True)
class Plan:
    """The slots that may serve one request, in the order they are tried, and the route's
    settings when the model is a [[routes]] one (None: a slot's own model, one slot)."""

    model: str  # the served name the client's name resolved to (its alias applied)
    routes: tuple[Route, ...]
    route: RouteConfig | None = None

    @property
    def first(self) -> Route:
        return self.routes[0]


class Router:
    def __init__(self, config: Config) -> None:
        self._plans: dict[str, Plan] = {
            model: Plan(model, (Route(slot, model),))
            for slot in config.slots for model in slot.models
        }
        by_name = {slot.name: slot for slot in config.slots}
        for route in config.routes:
            self._plans[route.model] = Plan(route.model, tuple(
                Route(by_name[name], route.served_by(name)) for name in route.slots), route)
        self._aliases = config.models

    def served_models(self) -> list[str]:
        return sorted(self._plans)

    def listed(self, key: Key | None) -> list[Plan]:
        """Every model `key` may use (None: every model), as the model lists show them: the
        slots' own models in the configuration's order, then the routes'."""
        return [plan for plan in self._plans.values()
                if key is None or key.may_use(plan.model)]

    def plan(self, model: str, key: Key | None = None) -> Plan:
        """The plan for the name a client asked for, its alias applied; NoRoute (404) listing
        the served models, those `key` may use when the request has a key."""
        served = self._served(model)
        plan = self._plans.get(served) if served is not None else None
        if plan is None:
            listed = [name for name in self.served_models() if key is None or key.may_use(name)]
            raise NoRoute(
                f"no slot serves model {model!r}; served models: " + (", ".join(listed) or "none"),
                field="model",
            )
        return plan

    def _served(self, model: str) -> str | None:
        """The served name `model` stands for: itself or its exact alias, then (a name with
        Ollama's `:latest`) the name without it or its exact alias; only then a glob alias."""
        names = (model, model.removesuffix(LATEST)) if model.endswith(LATEST) else (model,)
        for name in names:
            if name in self._plans:
                return name
            if name in self._aliases:
                return self._aliases[name]
        for name in names:
            if (target := alias_target(self._aliases, name)) is not None:
                return target
        return None

    def resolve(self, model: str, key: Key | None = None) -> Route:
        """The first slot of the model's plan."""
        return self.plan(model, key).first


def best(routes: Sequence[Route], state_of: Callable[[Route], str]) -> tuple[Route, str]:
    """The slot a model is shown by, and its state: of `routes` (a plan's, in the order they
    are tried), the first in the best state (READINESS), so a route whose first box is down but
    whose second answers is shown ready, by the second."""
    states = [(route, state_of(route)) for route in routes]
    return min(states, key=lambda pair: READINESS.get(pair[1], len(READINESS)))


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
