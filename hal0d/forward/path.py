"""The one forward path: a request's model resolved to its plan, and its exchange run on each
slot of the plan, from the lease to the record.

    Dispatch.serve(request, model, exchange)
      for each slot of the plan:              the model's plan (NoRoute 404) that the key may
                                              take (Forbidden 403), in order (prefer_loaded: warm
                                              slots first)
        Forward.run(exchange)
          exchange.prepare(route)             the surface's checks for this slot, before a wait
          exchange.unleased(fwd)              an answer that needs no lease (loads nothing)
          async with the lease:               the slot is made ready (the one place a request
                                              waits for its slot: its queue, its client's turn,
                                              a load)
            exchange.call(fwd)                what to send, or an answer made without the
                                              upstream
            open                              eagerly: 502/503 before any byte of the response
            classify                          status and content type:
              a stream's 200 event stream       relayed through the one relay loop, with the
                                                surface's transform, the stall guard, the tap
              anything else                     read whole: the surface's error (refused), or
                                                its whole answer
          (the block's exit)                  the upstream released (kept for reuse when read to
                                              the end, else closed: that stops its generation),
                                              then the lease

A slot's own model has a plan of one slot. A `[[routes]]` model's plan is its slots in order,
and a slot hands the request on to the next (HandOn) only while nothing has reached the client:
before its lease (spill_when_busy and no free place; a full queue, a failed load), and at its
open (no connection, a 5xx or a 429, no headers or no first byte of a stream within
first_byte_timeout_s). The last slot's answer or error is the client's, as a lone slot's would
be. Once a stream's first byte is written there is no hand-on: the stall guard ends it as it
ends any other.

What a request waited for (queue_ms, load_ms, turn_ms), its upstream status and what the relay
saw are written into the request's info here, on every exit; the lifecycle middleware records
it. The path is handed what it works with as one object, `Dispatch` (the slots, the one upstream
client, the token counter, the streams being relayed, the runtime settings): nothing below the
handlers looks anything up in `request.app`.
"""


from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from hal0d import conversations
from hal0d.errors import ErrorCode, Hal0Error
from hal0d.forward.attempt import Forward, HandOn
from hal0d.forward.contexts import Contexts
from hal0d.forward.exchange import Exchange
from hal0d.forward.keepalive import Waiting
from hal0d.forward.modes import AnthropicModes, ResponsesModes
from hal0d.forward.placement import Placement
from hal0d.keys import KEY
from hal0d.lifecycle.table import SlotTable
from hal0d.logs import get_logger
from hal0d.observability.requestinfo import INFO, RequestInfo, client_of
from hal0d.routing import Plan, Route, RuntimeRef
from hal0d.shares import DEFAULT_SHARE
from hal0d.transport.stallguard import StallGuard, client_bound_s
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import UpstreamClient

log = get_logger()


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What the forward path works with, handed to it as one."""

    runtime: RuntimeRef  # the settings of the moment; a reload points it at new ones
    slots: SlotTable
    upstreams: UpstreamClient
    tokens: TokenCounter
    anthropic_modes: AnthropicModes
    responses_modes: ResponsesModes
    # The stall guards of the streams being relayed now: a shutdown past its grace ends them,
    # a forced unload ends a slot's.
    streams: set[StallGuard]
    # Told each hand-on: (route, the slot that handed it on, why); the failover metrics.
    on_failover: Callable[[str, str, str], None] | None = None
    # Told each keepalive sent, with its surface: hal0d_keepalives_total.
    on_keepalive: Callable[[str], None] | None = None
    # The order of a route's slots (placement.py): its conversations' slots, its failing ones.
    placement: Placement = field(default_factory=lambda: Placement(SlotTable(())))
    # Each slot's context (contexts.py): what the guard measures a prompt against.
    contexts: Contexts | None = None

    async def serve(self, request: web.Request, model: str, exchange: Exchange, *,
                    client: str | None = None, slot: str | None = None,
                    conversation: str | None = None) -> web.StreamResponse:
        """`exchange` on each slot of the model's plan in turn (resolved now: NoRoute, 404, and
        the key's Forbidden, 403, before anything is taken), until one answers: a slot hands the
        request on (HandOn) only while nothing has reached the client and another slot is left,
        so the last one's answer or error is the client's. `client`: whose turn the request
        waits for in the slot queues (client_of, from the parsed body, which the surface need
        not keep for the stream's life); without it, the key's or the anonymous. `slot`: that
        slot of the plan alone, no hand-on (the one that holds a stored answer).
        `conversation`: the conversation the request continues (conversations.py), kept per
        `client`: the slot that served its last turn goes first, and the one that answers holds
        it now."""
        info, plan = self._resolve(request, model, exchange.stream)
        client = client or client_of(info, None)
        key = request.get(KEY)
        share = key.share if key is not None else DEFAULT_SHARE
        info.service_class = share.service_class
        # One client's conversation is never another's, whatever the two send alike.
        conversation = conversations.of_client(client, conversation)
        if slot is not None:
            routes: tuple[Route, ...] = (
                next((r for r in plan.routes if r.slot.name == slot), plan.first),)
        else:
            routes = self.order(plan, conversation)
        waiting = Waiting(request, exchange, every_s=0.0, bound_s=0.0, what=str,
                          on_sent=self.on_keepalive) if exchange.keeps_alive else None
        tried: list[str] = []
        try:
            for index, route in enumerate(routes):
                fwd = Forward(self, request, route, stream=exchange.stream,
                              route_config=plan.route, hands_on=index + 1 < len(routes),
                              client=client, share=share, waiting=waiting)
                if waiting is not None:
                    waiting.bound_s = client_bound_s(fwd.timeouts)
                info.attempts = index + 1
                try:
                    response = await fwd.run(exchange)
                except HandOn as exc:
                    tried.append(f"{route.slot.name}={exc.reason}")
                    info.failover = ",".join(tried)
                    self.handed_on(plan.model, route.slot.name, routes[index + 1].slot.name,
                                   exc.reason)
                    continue
                if info.ok and info.status == 200:
                    self.placement.affinity.served(conversation, route.slot.name)
                    self.placement.cooldowns.answered(route.slot.name)
                return response
        except Hal0Error as exc:
            if tried:  # the last slot failed too: its error, naming the slots before it
                exc.message += f" (tried before: {', '.join(tried)})"
            if waiting is None or not waiting.head_sent:
                raise
            return await self._failed_after_head(waiting, exc, info)
        finally:
            if waiting is not None:
                waiting.close()
        raise AssertionError("the last slot of a plan never hands a request on")

    @staticmethod
    async def _failed_after_head(waiting: Waiting, exc: Hal0Error,
                                 info: RequestInfo) -> web.StreamResponse:
        """A failure once a keepalive sent the head: the surface's terminal error frame ends the
        stream (an SDK raises), where a status can no longer be given."""
        response = await waiting.relay_head()
        waiting.answered()
        assert response is not None
        info.fail(exc.error_code)
        log.info("dispatch.failed_after_head", error_code=exc.error_code, message=exc.message)
        try:
            await response.write(waiting.exchange.failed(exc))
            await response.write_eof()
        except ConnectionResetError:
            info.fail(ErrorCode.CLIENT_DISCONNECT)
        return response

    def _resolve(self, request: web.Request, model: str, stream: bool
                 ) -> tuple[RequestInfo, Plan]:
        """The model's plan, that the request's key may take (NoRoute 404, Forbidden 403)."""
        info = request[INFO]
        info.model, info.stream = model, stream  # recorded even when no slot serves it
        key = request.get(KEY)
        plan = self.runtime.current.router.plan(model, key)
        if key is not None:
            key.check_model(model, plan.model)  # 403 naming the key
        return info, plan

    def order(self, plan: Plan, conversation: str | None = None) -> tuple[Route, ...]:
        return self.placement.order(plan, conversation)

    def warm(self, route: Route) -> bool:
        return self.placement.warm(route)

    def state_of(self, route: Route) -> str:
        return self.placement.state_of(route)

    def handed_on(self, route: str, slot: str, to: str, reason: str) -> None:
        """One line a hand-on; a slot that starts or stops failing is said once, as a warning
        (cooldown.py)."""
        log.info("dispatch.failover", route=route, to=to, reason=reason, **{"from": slot})
        self.placement.cooldowns.handed_on(slot, reason)
        if self.on_failover is not None:
            self.on_failover(route, slot, reason)

    def end_streams(self, slot: str, reason: str) -> int:
        """Ends the slot's streams with their surface's terminal frame; how many it ended."""
        ending = [guard for guard in self.streams if guard.upstream == slot]
        for guard in ending:
            guard.end_now(reason)
        return len(ending)
