"""The one forward path: every request that reaches a slot's upstream goes through `forward`.

    fwd = forward(request, model, stream=...)   resolve the model to a route (NoRoute, 404)
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
place where a request waits for its slot: in the slot's FIFO queue for capacity, while the slot
is starting for its process to answer, and for an on-demand slot that rests `stopped`, for the
load it asks for (lifecycle/manager.py); the wait for a load is the request's `load_ms`.
"""

from __future__ import annotations

from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from types import TracebackType
from typing import Any, Self

import aiohttp
from aiohttp import hdrs, web

from hal0d.appkeys import RUNTIME, SESSION, SLOTS, TOKEN_COUNTER
from hal0d.config import DispatcherConfig, SlotConfig
from hal0d.handlers.streaming import stream_through
from hal0d.lifecycle.slots import Lease
from hal0d.requestinfo import INFO, RequestInfo
from hal0d.routing import Route
from hal0d.stallguard import guard_active
from hal0d.transform import Transform
from hal0d.upstream import open_upstream, read_whole, request_headers


class Forward:
    """One request's way to its slot: the route, the lease, the slot's effective timeouts and,
    once opened, the upstream response. Entered once, as `async with`."""

    __slots__ = ("_lease_context", "info", "lease", "request", "route", "stream", "timeouts",
                 "upstream")

    def __init__(self, request: web.Request, model: str, *, stream: bool) -> None:
        info = request[INFO]
        info.model, info.stream = model, stream
        runtime = request.app[RUNTIME].current
        self.route: Route = runtime.router.resolve(model)
        info.served_model, info.slot = self.route.served_model, self.route.slot.name
        self.request = request
        self.info: RequestInfo = info
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
        self._lease_context = self.request.app[SLOTS].lease(self.route.slot.name)
        self.lease = await self._lease_context.__aenter__()
        self.info.queue_ms = self.lease.queue_ms
        self.info.load_ms = self.lease.load_ms
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
        self.upstream = upstream = await open_upstream(
            self.request.app[SESSION], self.route.slot, self.timeouts, method=method, path=path,
            params=params, headers=headers, body=body,
            guarded=self.stream and guard_active(self.timeouts),
            slot_reason=self.lease.slot.reason,
        )
        self.info.upstream_status(upstream.status)
        return upstream

    async def read_whole(self) -> bytes:
        """The opened upstream's whole body, within the slot's direct read timeout."""
        assert self.upstream is not None, "read_whole() after open() only"
        return await read_whole(self.upstream, self.route.slot, self.timeouts.direct_read_timeout_s)

    def relay(self, response: web.StreamResponse, transform: Transform) -> Awaitable[None]:
        """The opened upstream's body through the relay loop into `response` (to be awaited).
        Not a coroutine of its own: each level between the task and the relay's read is resumed
        once per chunk."""
        assert self.upstream is not None, "relay() after open() only"
        return stream_through(
            self.request,
            self.upstream,
            response,
            transform,
            timeouts=self.timeouts,
            slot_name=self.route.slot.name,
        )

    async def count_tokens(self, openai_request: dict[str, Any], text: str) -> tuple[int, str]:
        """The prompt's token count from the slot's own tokenizer (tokens.py), under the lease:
        llama-cpp-python's server interrupts a running completion when another request
        reaches it."""
        return await self.request.app[TOKEN_COUNTER].count(self.route.slot, openai_request, text)


def forward(request: web.Request, model: str, *, stream: bool) -> Forward:
    """The way to the slot that serves `model`, resolved now (NoRoute, 404, before anything
    is taken); `async with` it to take the slot and release everything after."""
    return Forward(request, model, stream=stream)


def release_upstream(upstream: aiohttp.ClientResponse) -> None:
    """Keep the connection for reuse when its body was read to the end; otherwise close it,
    which is what tells the upstream to stop generating."""
    if upstream.content.at_eof():
        upstream.release()
    else:
        upstream.close()
