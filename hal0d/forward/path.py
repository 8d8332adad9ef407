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

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp
from aiohttp import hdrs, web

from hal0d.config import DispatcherConfig, RouteConfig, SlotConfig
from hal0d.errors import (
    ErrorCode,
    Hal0Error,
    QueueFull,
    SlotLoadFailed,
    SlotLoading,
    UpstreamInvalid,
    UpstreamUnavailable,
)
from hal0d.forward.exchange import Answer, Call, Exchange, upstream_refusal
from hal0d.forward.keepalive import Waiting
from hal0d.forward.modes import AnthropicModes, ResponsesModes
from hal0d.forward.placement import Placement
from hal0d.keys import KEY
from hal0d.lifecycle.slots import LOADING, Lease
from hal0d.lifecycle.table import SlotTable
from hal0d.logs import get_logger
from hal0d.observability.requestinfo import INFO, RequestInfo, client_of
from hal0d.protocol.transform import Transform
from hal0d.routing import Plan, Route, RuntimeRef
from hal0d.transport.relay import Outcome, client_gone, relay
from hal0d.transport.stallguard import StallGuard, client_bound_s, guard_active
from hal0d.transport.tap import StreamTap
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import BODY_BROKEN, UpstreamClient, read_whole, request_headers

log = get_logger()

EVENT_STREAM: Final = "text/event-stream"


class HandOn(Exception):
    """Raised on the way to a slot while nothing has reached the client, when the plan has a next
    slot to try (Dispatch.serve): why this one did not answer, as a short stable word (the
    history's `failover` column, the `reason` label); the error it would have been is its
    __cause__."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


# The refusals of a slot's lease that another slot may not have.
_LEASE_REASONS: Final = {QueueFull: "queue_full", SlotLoadFailed: "load_failed",
                         SlotLoading: "loading"}


class Forward:
    """One request's way to one slot: the route, the lease, the slot's effective timeouts and,
    once opened, the upstream response. `hands_on`: another slot of the plan is left, so what
    another slot may not share (a full queue, a failed load, an unreachable upstream, a 5xx or
    429, an answer later than first_byte_timeout_s) is HandOn while nothing has reached the
    client. The exchange's hooks are handed this object: its route, slot, info and request, and
    the slot's own answers (count_tokens, the surface modes)."""

    __slots__ = ("_first_chunk", "client", "dispatch", "hands_on", "info", "lease", "request",
                 "route", "route_config", "stream", "timeouts", "upstream", "waiting")

    def __init__(self, dispatch: Dispatch, request: web.Request, route: Route, *,
                 stream: bool, route_config: RouteConfig | None, hands_on: bool,
                 client: str, waiting: Waiting | None = None) -> None:
        info = request[INFO]
        self.dispatch = dispatch
        self.route: Route = route
        info.served_model, info.slot = route.served_model, route.slot.name
        self.request = request
        self.info: RequestInfo = info
        self.client = client  # whose turn it waits for in the slot's queue
        self.stream = stream
        self.route_config = route_config
        self.hands_on = hands_on
        self.timeouts: DispatcherConfig = route.slot.timeouts(
            dispatch.runtime.current.config.dispatcher)
        self.lease: Lease | None = None
        self.upstream: aiohttp.ClientResponse | None = None
        self._first_chunk = b""
        self.waiting = waiting  # the stream's keepalive, across the plan's slots
        if waiting is not None:
            waiting.every_s, waiting.what = self.timeouts.keepalive_s, self.waiting_for

    @property
    def slot(self) -> SlotConfig:
        return self.route.slot

    @property
    def warm(self) -> bool:
        return self.dispatch.warm(self.route)

    def waiting_for(self) -> str:
        """What the request waits for now, in words for its keepalive."""
        waited = time.monotonic() - self.info.started
        if self.lease is None:
            slot = self.dispatch.slots.get(self.slot.name)
            if slot is not None and slot.state in LOADING:
                return f"loading {self.route.served_model}, {waited:.0f} s"
            queued = slot.queued if slot is not None else 0
            return f"queued for {self.slot.name}, {queued} waiting, {waited:.0f} s"
        if self.upstream is None:
            return f"preparing, {waited:.0f} s"
        return f"prefill, {waited:.0f} s"

    async def run(self, exchange: Exchange) -> web.StreamResponse:
        """The exchange on this slot, from its checks to its answer (the module's docstring).
        On every exit the upstream is released (kept for reuse when read to the end, else
        closed), then the lease."""
        exchange.prepare(self.route)
        if (unleased := exchange.unleased(self)) is not None:
            return unleased
        if self.waiting is not None:
            self.waiting.start()
        async with AsyncExitStack() as held:
            await self._take_lease(held)
            held.callback(self._release_upstream)
            call = await exchange.call(self)
            if isinstance(call, web.StreamResponse):
                return await self._in_head(call)
            shape = call.answered_by or exchange
            upstream = await self._open(call)
            answer = Answer(upstream.status, upstream.content_type, upstream.headers,
                            self.slot.name)
            relayed = self.stream and answer.status == 200 and (
                answer.content_type == EVENT_STREAM or not shape.sse)
            early = await self.waiting.relay_head() if self.waiting is not None else None
            if relayed:
                return await self._relay(shape, answer, early)
            if self.waiting is not None:
                self.waiting.answered()
            if early is not None or (self.stream and answer.status == 200 and shape.translated):
                raise await self._not_a_stream(shape, answer)
            if self.stream and answer.status == 200:
                # Asked for a stream, answered with something else: passed on as it came (status
                # and content type are the upstream's), recorded as the failure it is.
                self.info.fail(ErrorCode.UPSTREAM_INVALID)
            return await self._whole(shape, answer)
        # AsyncExitStack may swallow an exception by its type; none of what it holds does.
        raise AssertionError("unreachable: the block returns or raises")

    async def _take_lease(self, held: AsyncExitStack) -> None:
        """The slot made ready, here and only here (see the module's docstring); the lease is
        given back when `held` closes."""
        if self.hands_on and self._spills():
            raise HandOn("busy")
        try:
            self.lease = lease = await held.enter_async_context(
                self.dispatch.slots.lease(self.route.slot.name, self.client))
        except (QueueFull, SlotLoadFailed, SlotLoading) as exc:
            if self.hands_on:
                raise HandOn(_LEASE_REASONS[type(exc)]) from exc
            raise
        self.info.queue_ms = lease.queue_ms
        self.info.load_ms = lease.load_ms
        self.info.turn_ms = lease.turn_ms

    def _release_upstream(self) -> None:
        if self.upstream is not None:
            release_upstream(self.upstream)

    def _spills(self) -> bool:
        """spill_when_busy, and the slot has no free place (every place taken, or others
        already waiting for one)."""
        if self.route_config is None or not self.route_config.spill_when_busy:
            return False
        slot = self.dispatch.slots.get(self.route.slot.name)
        return slot is not None and (slot.queued > 0
                                     or slot.in_flight >= self.route.slot.max_concurrent)

    async def _whole(self, shape: Exchange, answer: Answer) -> web.StreamResponse:
        """The one whole-answer path: the body read within its bounds, then the surface's error
        or its answer."""
        data = await self.read_whole()
        if answer.status >= 400 and (error := shape.refused(answer, data)) is not None:
            raise error
        if not data and answer.status == 200 and not shape.empty_ok:
            raise UpstreamInvalid(f"slot {self.slot.name!r} answered 200 with an empty body")
        return shape.whole(self, answer, data)

    async def _not_a_stream(self, shape: Exchange, answer: Answer) -> Hal0Error:
        """Why a stream got no stream: the upstream's error status (the surface's refusal, else
        the upstream's own message), or an answer that is no event stream. Raised, it becomes
        the error status, or the terminal frame when the head is out (a keepalive sent it)."""
        data = await self.read_whole()
        if answer.status >= 400:
            return shape.refused(answer, data) or upstream_refusal(answer, data)
        return UpstreamInvalid(f"slot {self.slot.name!r} answered a streaming request with "
                               f"content-type {answer.content_type!r}, not text/event-stream")

    async def _in_head(self, response: web.StreamResponse) -> web.StreamResponse:
        """An answer the exchange made without the upstream (an Ollama load's one line): as it
        is, or, when a keepalive already sent the head, its body written into that stream."""
        early = await self.waiting.relay_head() if self.waiting is not None else None
        if self.waiting is not None:
            self.waiting.answered()
        if early is None:
            return response
        assert isinstance(response, web.Response) and isinstance(response.body, bytes)
        with contextlib.suppress(ConnectionResetError):
            await early.write(response.body)
            await early.write_eof()
        return early

    async def _relay(self, shape: Exchange, answer: Answer,
                     early: web.StreamResponse | None) -> web.StreamResponse:
        headers, transform = shape.relay(self, answer)
        response = early or web.StreamResponse(status=answer.status, headers=headers)
        try:
            await self.relay(response, transform)
        finally:
            shape.relayed(self, transform)
        return response

    async def _open(self, call: Call) -> aiohttp.ClientResponse:
        """Send the call to the slot and wait for the response headers; the status is the
        request's from here on."""
        assert self.lease is not None, "open under the lease only"
        if not self.hands_on:
            try:
                self.upstream = upstream = await self._opening(call)
            except UpstreamUnavailable as exc:
                # Its process may have died as the lease was granted: wait for its fate.
                if exc.kind != "connect_refused" or not await self.lease.slot.process_fate():
                    raise
                self.upstream = upstream = await self._opening(call)
        else:
            self.upstream = upstream = await self._open_or_hand_on(self._opening(call))
        self.info.upstream_status(upstream.status)
        return upstream

    def _opening(self, call: Call) -> Awaitable[aiohttp.ClientResponse]:
        assert self.lease is not None, "open under the lease only"
        headers = request_headers(self.request.headers, self.route.slot)
        if call.json_body:
            headers[hdrs.CONTENT_TYPE] = "application/json"
        return self.dispatch.upstreams.open(
            self.route.slot, self.timeouts, method=call.method, path=call.path,
            params=call.params, headers=headers, body=call.body,
            guarded=self.stream and guard_active(self.timeouts), whole=not self.stream,
            slot_reason=self.lease.slot.reason,
        )

    async def _open_or_hand_on(self, opening: Awaitable[aiohttp.ClientResponse]
                               ) -> aiohttp.ClientResponse:
        """The open, when another slot is left: no answer (UpstreamUnavailable), a 5xx or a 429,
        and for a stream no headers or no first byte of its body within first_byte_timeout_s
        (0: no bound of its own) is HandOn. The stream's first chunk, read here, is relayed
        first. A whole answer's headers come only when its generation ends: it is not handed on
        for being slow once its upstream took the request (that would generate it twice); its
        wait is its read timeout."""
        bound = self.route_config.first_byte_timeout_s if (
            self.route_config and self.stream) else 0.0
        started = time.monotonic()
        try:
            async with asyncio.timeout(bound or None):
                upstream = await opening
        except TimeoutError:
            raise HandOn("first_byte_timeout") from None
        except UpstreamUnavailable as exc:
            raise HandOn(exc.kind) from exc
        if upstream.status >= 500 or upstream.status == 429:
            upstream.close()  # tells the upstream to stop
            raise HandOn(f"status_{upstream.status}")
        if self.stream and bound and upstream.status == 200:
            self.upstream = upstream  # closed by the block's exit if the wait fails
            try:
                async with asyncio.timeout(bound - (time.monotonic() - started)):
                    self._first_chunk = await upstream.content.readany()
            except TimeoutError:
                raise HandOn("first_byte_timeout") from None
            except BODY_BROKEN as exc:
                raise HandOn("disconnected") from exc
        return upstream

    async def read_whole(self) -> bytes:
        """The opened upstream's whole body: within the bounds of its open for a whole answer,
        within the slot's direct read timeout for a stream's answer read whole."""
        assert self.upstream is not None, "read_whole() after the open only"
        bound = self.timeouts.direct_read_timeout_s if self.stream else None
        return await read_whole(self.upstream, self.route.slot, bound)

    def relay(self, response: web.StreamResponse, transform: Transform) -> Awaitable[None]:
        """The opened upstream's body through the relay loop into `response` (to be awaited).
        Not a coroutine of its own: each level between the task and the relay's read is resumed
        once per chunk."""
        assert self.upstream is not None, "relay() after the open only"
        return self._stream(self.upstream, response, transform)

    async def _stream(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse,
                      transform: Transform) -> None:
        """Around the relay: the stall guard registered for a shutdown, the metrics tap, and
        the outcome written into the request's info on every exit, cancellation included."""
        info, request = self.info, self.request
        try:
            await response.prepare(request)
        except ConnectionResetError:
            # The client left as the upstream answered; aiohttp's finish ignores the rest.
            info.fail(ErrorCode.CLIENT_DISCONNECT)
            return
        # Tokens are only in event streams; an audio body would be searched for them to no end.
        tap = StreamTap(info.started) if upstream.content_type == EVENT_STREAM else None
        guard = StallGuard(self.timeouts, self.route.slot.name, reader=upstream.content,
                           abort_client=abort_client(request))
        streams = self.dispatch.streams
        streams.add(guard)
        waiting = self.waiting
        if waiting is not None:
            waiting.adopt(response)  # its keepalives go on in it until the first chunk
        outcome = None
        try:
            outcome = await relay(upstream, response, transform, guard, tap,
                                  first_chunk=self._first_chunk,
                                  answered=waiting.answered if waiting is not None else None)
        except asyncio.CancelledError:
            if transform.complete():
                # The client had the whole answer and closed before the upstream ended its
                # body, as the openai SDK does on reading [DONE]: finished, not a disconnect.
                info.answered = True
            else:
                # The client went away while a write waited, or the guard cut it (the
                # cancellation follows its abort): recorded here, before the middleware's
                # client_disconnect.
                info.fail(client_gone(guard))
            raise
        finally:
            streams.discard(guard)
            record_stream(info, outcome, tap)  # outcome None: cancelled, the client went away

    async def count_tokens(self, openai_request: dict[str, Any], text: str) -> tuple[int, str]:
        """The prompt's token count from the slot's own tokenizer (tokens.py), under the lease:
        llama-cpp-python's server interrupts a running completion when another request
        reaches it."""
        loaded = self.lease is not None and bool(self.lease.load_ms)
        return await self.dispatch.tokens.count(self.route.slot, openai_request, text,
                                                after_load=loaded)

    async def anthropic_mode(self) -> str:
        """How the slot serves the Anthropic API (modes.py), asked of its upstream once, under
        the lease."""
        return await self.dispatch.anthropic_modes.mode(self.dispatch.upstreams, self.route.slot,
                                                        self._generation())

    async def responses_mode(self) -> str:
        """How the slot serves the Responses API (native or translated), asked of its upstream
        once, under the lease."""
        return await self.dispatch.responses_modes.mode(self.dispatch.upstreams, self.route.slot,
                                                        self._generation())

    def _generation(self) -> int:
        """Which run of the slot's process the lease is on (the modes are asked per run)."""
        return self.lease.slot.generation if self.lease is not None else 0


def release_upstream(upstream: aiohttp.ClientResponse) -> None:
    """Keep the connection for reuse when its body was read to the end; otherwise close it,
    which is what tells the upstream to stop generating."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()


def record_stream(info: RequestInfo, outcome: Outcome | None, tap: StreamTap | None) -> None:
    """What the relay saw, into the request's info; `outcome` is None when the relay did not
    return (cancelled)."""
    if outcome is not None and not outcome.ok and outcome.error_code:
        info.fail(outcome.error_code)
    if tap is None:
        return
    info.ttft_ms = tap.ttft_ms
    info.apply_usage(tap.usage())
    if info.completion_tokens is None:
        info.completion_tokens = tap.completion_tokens()
    info.tokens_per_s = tap.decode_tokens_per_s()


def abort_client(request: web.Request) -> Callable[[], None]:
    def abort() -> None:
        if request.transport is not None:
            request.transport.abort()

    return abort


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
        `conversation`: the conversation the request continues (conversations.py): the slot
        that served its last turn goes first, and the one that answers holds it now."""
        info, plan = self._resolve(request, model, exchange.stream)
        if slot is not None:
            routes: tuple[Route, ...] = (
                next((r for r in plan.routes if r.slot.name == slot), plan.first),)
        else:
            routes = self.order(plan, conversation)
        client = client or client_of(info, None)
        waiting = Waiting(request, exchange, every_s=0.0, bound_s=0.0, what=str,
                          on_sent=self.on_keepalive) if exchange.keeps_alive else None
        tried: list[str] = []
        try:
            for index, route in enumerate(routes):
                fwd = Forward(self, request, route, stream=exchange.stream,
                              route_config=plan.route, hands_on=index + 1 < len(routes),
                              client=client, waiting=waiting)
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
