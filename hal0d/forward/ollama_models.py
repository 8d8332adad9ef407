"""The Ollama API's model lists (/api/tags, /api/show, /api/ps), read here alone, from what the
forward path works with (Dispatch): the models a key may use (the runtime's router), which of a
plan's slots have its model loaded (in the order they would answer: Dispatch.order and
state_of, as /v1/models reads them), what the model can do and the context its server holds
(ollama/capabilities.py, from the slot's declaration, its command, or its server's /props), and,
from the lifecycle manager, when a loaded model unloads.

The handlers (handlers/ollama.py) parse the request and answer with what these return; the
shapes are ollama/response.py's.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, Final

from hal0d.forward.path import Dispatch
from hal0d.keys import Key
from hal0d.lifecycle.slots import SlotState
from hal0d.ollama import capabilities
from hal0d.ollama import response as shapes
from hal0d.routing import Plan, Route

# The models are hal0d's configuration's: known since it started.
STARTED: Final = time.time()
# The states in which a slot has its model loaded (as another hal0d reports them too).
UP: Final = frozenset({str(SlotState.READY), str(SlotState.SERVING)})


class OllamaModels:
    """The three lists, handed the dispatch and the lifecycle manager's `unloads_in` (seconds
    until a slot's idle timer unloads it, None when nothing will); they keep what each slot's
    server said of itself (UpstreamProps: asked once per run of its process)."""

    def __init__(self, dispatch: Dispatch, unloads_in: Callable[[str], float | None]) -> None:
        self.dispatch = dispatch
        self.unloads_in = unloads_in
        assert dispatch.contexts is not None, "the app's dispatch knows the slots' contexts"
        self.contexts = dispatch.contexts

    def listed(self, key: Key | None) -> list[Plan]:
        """Every model `key` may use."""
        return self.dispatch.runtime.current.router.listed(key)

    async def tags(self, key: Key | None) -> dict[str, Any]:
        shown = await asyncio.gather(*(self.served(plan) for plan in self.listed(key)))
        return shapes.tags(shown, STARTED)

    async def show(self, plan: Plan, name: str) -> dict[str, Any]:
        """`plan`'s model, named as the client asked for it."""
        return shapes.show(await self.served(plan, name), STARTED)

    async def ps(self, key: Key | None) -> dict[str, Any]:
        """The models that are loaded, with when each unloads (never, for a slot hal0d does not
        unload): a slot's own while its slot is up, a route's while any of its slots has it up
        (shown by the one that would answer first, unloading when the last of them does)."""
        loaded: list[tuple[shapes.Served, float | None]] = []
        for plan in self.listed(key):
            up = self.up_routes(plan)
            if up:
                expiries = [self.unloads_in(route.slot.name) for route in up]
                expires = None if None in expiries else max(e for e in expiries if e is not None)
                loaded.append((await self.served(plan, slot=up[0]), expires))
        return shapes.ps(loaded, time.time())

    async def served(self, plan: Plan, name: str | None = None,
                     slot: Route | None = None) -> shapes.Served:
        """`plan`'s model as the lists show it, named `name` (the client's, else the served one):
        a slot's own with its slot; a route's as the route, with `slot` when one has it loaded
        (what it can do is that slot's model's, else the first up slot's, else its first
        slot's)."""
        source = slot or next(iter(self.up_routes(plan)), plan.first)
        can, context = await self.described(source)
        if plan.route is None:
            return shapes.Served(name or plan.model, plan.first.slot.name,
                                 plan.first.slot.memory_mib, can, context,
                                 file=plan.first.slot.library)
        return shapes.Served(name or plan.model, slot.slot.name if slot else None,
                             slot.slot.memory_mib if slot else None, can, context,
                             route=plan.model, slots=plan.route.slots)

    def up_routes(self, plan: Plan) -> list[Route]:
        """The plan's slots that have its model loaded, in the order they would answer."""
        dispatch = self.dispatch
        return [route for route in dispatch.order(plan) if dispatch.state_of(route) in UP]

    async def described(self, route: Route) -> tuple[tuple[str, ...], int]:
        """What the route's model can do (ollama/capabilities.py) and the context a request
        has there (forward/contexts.py): what the slot declares, else what its server says of
        itself (while it is not up, what its last process of the same command said)."""
        config = route.slot
        props = await self.contexts.server_props(config)
        entry = config.library
        from_file = capabilities.of_file(entry.chat_template, entry.mmproj is not None) if (
            entry is not None) else None
        can = capabilities.capabilities(config.declared_capabilities(route.served_model),
                                        config.command, props, from_file)
        context = self.contexts.from_server(props, config)
        return can, context.tokens if context is not None else 0
