"""The one forward path: every request that reaches a slot's upstream goes through `forward`.

    fwd = dispatch.forward(request, model,      resolve the model to a route (NoRoute, 404)
                           stream=...)
    async with fwd:                             take a lease on the slot: the slot is made ready
        await fwd.open(path, body)              open the upstream eagerly (502/503 before any
                                                byte of the client response)
        await fwd.relay(response, transform)    relay the stream through the one relay loop,
        await fwd.read_whole()                  or read the whole answer
    (the block's exit)                          release the upstream (kept for reuse when read to
                                                the end, else closed), then the lease

The surfaces (handlers/openai.py, handlers/anthropic.py) parse and validate their request, call
forward, and shape the answer; none of them takes a lease or touches an upstream connection.
Resolving is apart from the lease so a surface can build its upstream body from the route (the
served model name, the slot's limits) before it waits for the slot.

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
from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import aiohttp
from aiohttp import hdrs, web

from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.errors import ErrorCode
from hal0d.lifecycle.routing import Route, RuntimeRef
from hal0d.lifecycle.slots import Lease, SlotTable
from hal0d.observability.requestinfo import INFO, RequestInfo, client_of
from hal0d.protocol.transform import Transform
from hal0d.transport.anthropic_mode import AnthropicModes
from hal0d.transport.relay import Outcome, client_gone, relay
from hal0d.transport.stallguard import StallGuard, guard_active
from hal0d.transport.tap import StreamTap
from hal0d.transport.tokens import TokenCounter
from hal0d.transport.upstream import UpstreamClient, read_whole, request_headers


@dataclass(frozen=True, slots=True)
class Dispatch:
    """What the forward path works with, handed to it as one."""

    runtime: RuntimeRef  # the settings of the moment; a reload points it at new ones
    slots: SlotTable
    upstreams: UpstreamClient
    tokens: TokenCounter
    anthropic_modes: AnthropicModes
    # The stall guards of the streams being relayed now: a shutdown past its grace ends them,
    # a forced unload ends a slot's.
    streams: set[StallGuard]

    def forward(self, request: web.Request, model: str, *, stream: bool,
                payload: Mapping[str, Any] | None = None) -> Forward:
        """The way to the slot that serves `model`, resolved now (NoRoute, 404, before anything
        is taken); `async with` it to take the slot and release everything after. `payload`,
        the request's parsed body, names its client for the slot queue's turns."""
        return Forward(self, request, model, stream=stream, payload=payload)

    def end_streams(self, slot: str, reason: str) -> int:
        """Ends the slot's streams with their surface's terminal frame; how many it ended."""
        ending = [guard for guard in self.streams if guard.upstream == slot]
        for guard in ending:
            guard.end_now(reason)
        return len(ending)


class Forward:
    """One request's way to its slot: the route, the lease, the slot's effective timeouts and,
    once opened, the upstream response. Entered once, as `async with`."""

    __slots__ = ("_lease_context", "client", "dispatch", "info", "lease", "request", "route",
                 "stream", "timeouts", "upstream")

    def __init__(self, dispatch: Dispatch, request: web.Request, model: str, *,
                 stream: bool, payload: Mapping[str, Any] | None = None) -> None:
        info = request[INFO]
        info.model, info.stream = model, stream
        runtime = dispatch.runtime.current
        self.dispatch = dispatch
        self.route: Route = runtime.router.resolve(model)
        info.served_model, info.slot = self.route.served_model, self.route.slot.name
        self.request = request
        self.info: RequestInfo = info
        self.client = client_of(info, payload)  # whose turn it waits for in the slot's queue
        self.stream = stream
        self.timeouts: DispatcherConfig = self.route.slot.timeouts(runtime.config.dispatcher)
        self.lease: Lease | None = None
        self.upstream: aiohttp.ClientResponse | None = None
        self._lease_context: AbstractAsyncContextManager[Lease] | None = None

    @property
    def slot(self) -> SlotConfig:
        return self.route.slot

    async def __aenter__(self) -> Self:
        # The slot is made ready here and only here (see the module's docstring).
        self._lease_context = self.dispatch.slots.lease(self.route.slot.name, self.client)
        self.lease = await self._lease_context.__aenter__()
        self.info.queue_ms = self.lease.queue_ms
        self.info.load_ms = self.lease.load_ms
        self.info.turn_ms = self.lease.turn_ms
        return self

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
        self.upstream = upstream = await self.dispatch.upstreams.open(
            self.route.slot, self.timeouts, method=method, path=path,
            params=params, headers=headers, body=body,
            guarded=self.stream and guard_active(self.timeouts), whole=not self.stream,
            slot_reason=self.lease.slot.reason,
        )
        self.info.upstream_status(upstream.status)
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
            outcome = await relay(upstream, response, transform, guard, tap)
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
