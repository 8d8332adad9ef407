"""One request's way to one slot of its plan (Forward.run): the surface's checks, the lease, the
open, the classification of the upstream's answer (status, content type), the whole answer or
the relay of a stream, and the release of the upstream and the lease on every exit. What a slot
may hand on to the next of its plan while nothing has reached the client is raised as HandOn;
the dispatch (path.py) runs a Forward on each slot in turn and catches it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any, Final, Protocol

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
from hal0d.forward.context_guard import ContextNeed, measure, refusal, shortened
from hal0d.forward.contexts import Contexts
from hal0d.forward.exchange import Answer, Call, Exchange, upstream_refusal
from hal0d.forward.keepalive import Waiting
from hal0d.forward.modes import AnthropicModes, ResponsesModes
from hal0d.lifecycle.slots import Lease, LeaseContext
from hal0d.lifecycle.table import SlotTable
from hal0d.lifecycle.vocabulary import LOADING, UP
from hal0d.observability.requestinfo import INFO, RequestInfo
from hal0d.protocol.transform import Transform
from hal0d.routing import Route, RuntimeRef
from hal0d.shares import DEFAULT_SHARE, Share
from hal0d.transport.relay import Outcome, client_gone, relay
from hal0d.transport.stallguard import StallGuard, guard_active
from hal0d.transport.tap import StreamTap
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import BODY_BROKEN, UpstreamClient, read_whole, request_headers

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


class Collaborators(Protocol):
    """What a Forward works with of the dispatch (path.Dispatch), handed to it as one: the
    slots, the one upstream client, the token counter, the surface modes, the streams being
    relayed, the runtime settings. Named here by what this module reads of it, so that the
    dispatch, which runs a Forward on each slot of a plan, is the one module that knows both."""

    @property
    def runtime(self) -> RuntimeRef: ...

    @property
    def slots(self) -> SlotTable: ...

    @property
    def upstreams(self) -> UpstreamClient: ...

    @property
    def tokens(self) -> TokenCounter: ...

    @property
    def anthropic_modes(self) -> AnthropicModes: ...

    @property
    def responses_modes(self) -> ResponsesModes: ...

    @property
    def streams(self) -> set[StallGuard]: ...

    def warm(self, route: Route) -> bool: ...

    @property
    def contexts(self) -> Contexts | None: ...


class Forward:
    """One request's way to one slot: the route, the lease, the slot's effective timeouts and,
    once opened, the upstream response. `hands_on`: another slot of the plan is left, so what
    another slot may not share (a full queue, a failed load, an unreachable upstream, a 5xx or
    429, an answer later than first_byte_timeout_s) is HandOn while nothing has reached the
    client. The exchange's hooks are handed this object: its route, slot, info and request, and
    the slot's own answers (count_tokens, the surface modes)."""

    __slots__ = ("_first_chunk", "_queued", "client", "dispatch", "hands_on", "info", "lease",
                 "request", "route", "route_config", "share", "stream", "timeouts", "upstream",
                 "waiting")

    def __init__(self, dispatch: Collaborators, request: web.Request, route: Route, *,
                 stream: bool, route_config: RouteConfig | None, hands_on: bool,
                 client: str, share: Share = DEFAULT_SHARE,
                 waiting: Waiting | None = None) -> None:
        info = request[INFO]
        self.dispatch = dispatch
        self.route: Route = route
        info.served_model, info.slot = route.served_model, route.slot.name
        self.request = request
        self.info: RequestInfo = info
        self.client = client  # whose turn it waits for in the slot's queue
        self.share = share  # its key's class and weight there (hal0d/shares)
        self._queued: LeaseContext | None = None  # the lease being waited for
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
            ahead = self._queued.ahead() if self._queued is not None else None
            if ahead is None:  # not in the queue: granted this instant
                return f"queued for {self.slot.name}, {waited:.0f} s"
            return f"queued for {self.slot.name}, {ahead} ahead ({self.share.service_class})"
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
        if (need := exchange.need()) is not None:
            await self._fits(need)
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

    async def _fits(self, need: ContextNeed) -> None:
        """The context guard (context_guard.py), before the lease: a prompt that does not fit
        goes on to the route's next slot, or is refused in the client's words."""
        contexts = self.dispatch.contexts
        if contexts is None:
            return
        live = self.dispatch.slots.get(self.slot.name)
        up = live is not None and live.state in UP
        busy = live is not None and live.in_flight > 0
        tokens = self.dispatch.tokens
        fit = await measure(need, contexts, tokens, self.slot, up=up, busy=busy)
        if not fit.fits and not self.hands_on and need.drop_oldest is not None:
            # Ollama's: the oldest messages go, each cut measured again.
            fit = await shortened(need, fit, lambda: measure(need, contexts, tokens, self.slot,
                                                             up=up, busy=busy))
        if fit.counted is not None:
            self.info.prompt_tokens = fit.counted
        if fit.fits or fit.context is None:
            return
        self.info.context_tokens = fit.context.tokens
        refused = refusal(need, fit, self.slot.name, hands_on=self.hands_on)
        if self.hands_on:
            raise HandOn("context") from refused
        raise refused

    async def _take_lease(self, held: AsyncExitStack) -> None:
        """The slot made ready, here and only here (see the module's docstring); the lease is
        given back when `held` closes."""
        if self.hands_on and self._spills():
            raise HandOn("busy")
        try:
            self._queued = self.dispatch.slots.lease(self.route.slot.name, self.client,
                                                     self.share)
            self.lease = lease = await held.enter_async_context(self._queued)
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
        if self.lease.slot.process_gone():
            # Granted as its process died, before the exit was told: nothing of the slot's
            # listens on its port, and whatever does now must not get the request.
            if self.hands_on:
                raise HandOn("connect_refused")
            await self.lease.slot.process_fate()
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

