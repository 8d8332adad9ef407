"""The one forward path: every request that reaches a slot's upstream goes through here.

    async def attempt(fwd):                     the surface's work on one slot: its own body for
        ...                                     the slot (its served model name, its limits)
        async with fwd:                         take a lease on the slot: the slot is made ready
            await fwd.open(path, body)          open the upstream eagerly (502/503 before any
                                                byte of the client response)
            await fwd.relay(response, transform)  relay the stream through the one relay loop,
            await fwd.read_whole()              or read the whole answer
        (the block's exit)                      release the upstream (kept for reuse when read
                                                to the end, else closed), then the lease
    await dispatch.serve(request, model,        resolve the model to its plan (NoRoute, 404)
                         stream=..., attempt=attempt)  that the key may take (Forbidden, 403),
                                                and `attempt` each of its slots in turn

A slot's own model has a plan of one slot. A `[[routes]]` model's plan is its slots in order
(the warm ones first with prefer_loaded), and a slot hands the request on to the next (HandOn)
only while nothing has reached the client: before its lease (spill_when_busy and no free place;
a full queue, a failed load), and at its open (no connection, a 5xx or a 429, no headers or no
first byte of a stream within first_byte_timeout_s). The last slot's answer or error is the
client's, as a lone slot's would be. Once a stream's first byte is written there is no hand-on:
the stall guard ends it as it ends any other.

The surfaces (handlers/openai.py, handlers/anthropic.py, handlers/responses.py) parse and validate
their request, call serve, and shape the answer; none of them takes a lease or touches an upstream
connection. An attempt's work before `async with` is apart from the lease so a surface can build
its upstream body from the route before it waits for the slot.

Before the upstream is opened, the slot is made ready, and taking the lease is that step, the one
place where a request waits for its slot: in the slot's queue for capacity, in its client's
turn (`client_of`: the key's name, else the body's user, else the one anonymous client), while
the slot is starting for its process to answer, and for an on-demand slot that rests `stopped`,
for the load it asks for (lifecycle/manager.py); the wait for a load is the request's `load_ms`.

The path is handed what it works with as one object, `Dispatch` (the slots, the one upstream
client, the token counter, the streams being relayed, the runtime settings): the surfaces take it
from the app once (appkeys.DISPATCH) and nothing below looks anything up in `request.app`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Final, Self, TypeVar

import aiohttp
from aiohttp import hdrs, web

from hal0d.config import DispatcherConfig, RouteConfig, SlotConfig
from hal0d.errors import (
    ErrorCode,
    Hal0Error,
    QueueFull,
    SlotLoadFailed,
    SlotLoading,
    UpstreamUnavailable,
)
from hal0d.keys import KEY
from hal0d.lifecycle.machine import SlotState
from hal0d.lifecycle.remote import KIND_HAL0D, RemoteModels
from hal0d.lifecycle.routing import Plan, Route, RuntimeRef
from hal0d.lifecycle.slots import Lease, SlotTable
from hal0d.logs import get_logger
from hal0d.observability.requestinfo import INFO, RequestInfo, client_of
from hal0d.protocol.transform import Transform
from hal0d.transport.anthropic_mode import AnthropicModes, ResponsesModes
from hal0d.transport.relay import Outcome, client_gone, relay
from hal0d.transport.stallguard import StallGuard, guard_active
from hal0d.transport.tap import StreamTap
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import BODY_BROKEN, UpstreamClient, read_whole, request_headers

log = get_logger()
T = TypeVar("T")


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
# Prefer-loaded order: a slot in these states answers without a load.
_WARM: Final = frozenset({SlotState.READY, SlotState.SERVING, SlotState.STARTING})


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
    # What other hal0d boxes (slots of kind "hal0d") report loaded.
    remote: RemoteModels | None = None

    async def serve(self, request: web.Request, model: str, *, stream: bool,
                    attempt: Callable[[Forward], Awaitable[T]], client: str | None = None) -> T:
        """`attempt` on the way to each slot of the model's plan in turn (resolved now: NoRoute,
        404, and the key's Forbidden, 403, before anything is taken), until one answers: a slot
        hands the request on (HandOn) only while nothing has reached the client and another
        slot is left, so the last one's answer or error is the client's. `attempt` does its
        slot's own preparation, then `async with fwd:` its work on the slot. `client`: whose turn
        the request waits for in the slot queues (client_of, from the parsed body, which the
        surface need not keep for the stream's life); without it, the key's or the anonymous."""
        info, plan = self._resolve(request, model, stream)
        routes = self.order(plan)
        client = client or client_of(info, None)
        tried: list[str] = []
        for index, route in enumerate(routes):
            fwd = Forward(self, request, route, stream=stream, route_config=plan.route,
                          hands_on=index + 1 < len(routes), client=client)
            info.attempts = index + 1
            try:
                return await attempt(fwd)
            except HandOn as exc:
                tried.append(f"{route.slot.name}={exc.reason}")
                info.failover = ",".join(tried)
                self.handed_on(plan.model, route.slot.name, routes[index + 1].slot.name,
                               exc.reason)
            except Hal0Error as exc:
                if tried:  # the last slot failed too: its error, naming the slots before it
                    exc.message += f" (tried before: {', '.join(tried)})"
                raise
        raise AssertionError("the last slot of a plan never hands a request on")

    def _resolve(self, request: web.Request, model: str, stream: bool
                 ) -> tuple[RequestInfo, Plan]:
        """The model's plan, that the request's key may take (NoRoute 404, Forbidden 403)."""
        info = request[INFO]
        info.model, info.stream = model, stream  # recorded even when no slot serves it
        plan = self.runtime.current.router.plan(model)
        if (key := request.get(KEY)) is not None:
            key.check_model(model, plan.model)  # 403 naming the key
        return info, plan

    def order(self, plan: Plan) -> tuple[Route, ...]:
        """The plan's slots in the order they are tried: as configured, the slots whose model is
        loaded first when the route says prefer_loaded."""
        if plan.route is None or not plan.route.prefer_loaded:
            return plan.routes
        return tuple(sorted(plan.routes, key=lambda route: not self.warm(route)))

    def warm(self, route: Route) -> bool:
        """Whether the slot answers without a load: its process is up or coming up, it has none
        to do (no on-demand command), or, another hal0d, that one reports the model so."""
        slot = route.slot
        if slot.kind == KIND_HAL0D:
            state = self.remote.state(slot.name, route.served_model) if self.remote else None
            return state is not None and state in _WARM
        live = self.slots.get(slot.name)
        return not slot.on_demand or (live is not None and live.state in _WARM)

    def handed_on(self, route: str, slot: str, to: str, reason: str) -> None:
        log.warning("dispatch.failover", route=route, to=to, reason=reason, **{"from": slot})
        if self.on_failover is not None:
            self.on_failover(route, slot, reason)

    def forward(self, request: web.Request, model: str, *, stream: bool,
                slot: str | None = None) -> Forward:
        """The way to one slot of the model's plan alone (no hand-on): `slot` when the plan has
        it (the one that holds a stored answer), else its first; resolved now (NoRoute, 404).
        `async with` it to take the slot and release everything after."""
        info, plan = self._resolve(request, model, stream)
        route = next((r for r in plan.routes if r.slot.name == slot), plan.first)
        return Forward(self, request, route, stream=stream, route_config=plan.route,
                       hands_on=False, client=client_of(info, None))

    def end_streams(self, slot: str, reason: str) -> int:
        """Ends the slot's streams with their surface's terminal frame; how many it ended."""
        ending = [guard for guard in self.streams if guard.upstream == slot]
        for guard in ending:
            guard.end_now(reason)
        return len(ending)


class Forward:
    """One request's way to one slot: the route, the lease, the slot's effective timeouts and,
    once opened, the upstream response. Entered once, as `async with`. `hands_on`: another slot
    of the plan is left, so what another slot may not share (a full queue, a failed load, an
    unreachable upstream, a 5xx or 429, an answer later than first_byte_timeout_s) is HandOn
    while nothing has reached the client."""

    __slots__ = ("_first_chunk", "_lease_context", "client", "dispatch", "hands_on", "info",
                 "lease", "request", "route", "route_config", "stream", "timeouts", "upstream")

    def __init__(self, dispatch: Dispatch, request: web.Request, route: Route, *,
                 stream: bool, route_config: RouteConfig | None, hands_on: bool,
                 client: str) -> None:
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
        self._lease_context: AbstractAsyncContextManager[Lease] | None = None
        self._first_chunk = b""

    @property
    def slot(self) -> SlotConfig:
        return self.route.slot

    async def __aenter__(self) -> Self:
        # The slot is made ready here and only here (see the module's docstring).
        if self.hands_on and self._spills():
            raise HandOn("busy")
        self._lease_context = self.dispatch.slots.lease(self.route.slot.name, self.client)
        try:
            self.lease = await self._lease_context.__aenter__()
        except (QueueFull, SlotLoadFailed, SlotLoading) as exc:
            if self.hands_on:
                raise HandOn(_LEASE_REASONS[type(exc)]) from exc
            raise
        self.info.queue_ms = self.lease.queue_ms
        self.info.load_ms = self.lease.load_ms
        self.info.turn_ms = self.lease.turn_ms
        return self

    def _spills(self) -> bool:
        """spill_when_busy, and the slot has no free place (every place taken, or others
        already waiting for one)."""
        if self.route_config is None or not self.route_config.spill_when_busy:
            return False
        slot = self.dispatch.slots.get(self.route.slot.name)
        return slot is not None and (slot.queued > 0
                                     or slot.in_flight >= self.route.slot.max_concurrent)

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            if self.upstream is not None:
                release_upstream(self.upstream)
        finally:
            if self._lease_context is not None:
                await self._lease_context.__aexit__(exc_type, exc, tb)

    async def open(
        self,
        path: str,
        body: bytes,
        *,
        json_body: bool = True,
        params: Any = None,
        method: str = hdrs.METH_POST,
    ) -> aiohttp.ClientResponse:
        """Send `body` to the slot's `path` (a POST unless `method` says otherwise) and wait for
        the response headers; the status is the request's from here on. `json_body`: say the
        body is JSON, whatever the client said.
        """
        assert self.lease is not None, "open() inside `async with forward(...)` only"
        headers = request_headers(self.request.headers, self.route.slot)
        if json_body:
            headers[hdrs.CONTENT_TYPE] = "application/json"
        opening = self.dispatch.upstreams.open(
            self.route.slot, self.timeouts, method=method, path=path,
            params=params, headers=headers, body=body,
            guarded=self.stream and guard_active(self.timeouts), whole=not self.stream,
            slot_reason=self.lease.slot.reason,
        )
        if not self.hands_on:
            self.upstream = upstream = await opening
        else:
            self.upstream = upstream = await self._open_or_hand_on(opening)
        self.info.upstream_status(upstream.status)
        return upstream

    async def _open_or_hand_on(self, opening: Awaitable[aiohttp.ClientResponse]
                               ) -> aiohttp.ClientResponse:
        """The open, when another slot is left: no answer (UpstreamUnavailable), a 5xx or a 429,
        or for a stream no first byte of its body, within first_byte_timeout_s (0: no bound of
        its own) is HandOn. The stream's first chunk, read here, is relayed first."""
        bound = self.route_config.first_byte_timeout_s if self.route_config else 0.0
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
        assert self.upstream is not None, "read_whole() after open() only"
        bound = self.timeouts.direct_read_timeout_s if self.stream else None
        return await read_whole(self.upstream, self.route.slot, bound)

    def relay(self, response: web.StreamResponse, transform: Transform) -> Awaitable[None]:
        """The opened upstream's body through the relay loop into `response` (to be awaited).
        Not a coroutine of its own: each level between the task and the relay's read is resumed
        once per chunk."""
        assert self.upstream is not None, "relay() after open() only"
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
        tap = StreamTap(info.started) if upstream.content_type == "text/event-stream" else None
        guard = StallGuard(self.timeouts, self.route.slot.name, reader=upstream.content,
                           abort_client=abort_client(request))
        streams = self.dispatch.streams
        streams.add(guard)
        outcome = None
        try:
            outcome = await relay(upstream, response, transform, guard, tap,
                                  first_chunk=self._first_chunk)
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
        return await self.dispatch.tokens.count(self.route.slot, openai_request, text)

    async def anthropic_mode(self) -> str:
        """How the slot serves the Anthropic API (transport/anthropic_mode.py), asked of its
        upstream once, under the lease."""
        return await self.dispatch.anthropic_modes.mode(self.dispatch.upstreams, self.route.slot)

    async def responses_mode(self) -> str:
        """How the slot serves the Responses API (native or translated), asked of its upstream
        once, under the lease."""
        return await self.dispatch.responses_modes.mode(self.dispatch.upstreams, self.route.slot)


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
