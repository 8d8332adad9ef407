"""Keepalive while a streamed request waits: no client gives up while the box works.

The longest waits come before the first token: the request's queue or its client's turn, a
model's load, the prefill of a long prompt. A client with an idle read timeout gives up on a
socket that says nothing for that long, although hal0d is doing what it asked. So once a
streamed request has waited `keepalive_s` with nothing to send, it gets its response head (the
surface's own stream headers, status 200) and then, every `keepalive_s`, its surface's keepalive
(exchange.py: an SSE comment naming what it waits for, Anthropic's `event: ping`, an empty
Ollama object), until the upstream's first chunk arrives and the relay takes over.

    Waiting.start()             the timer runs from the request's first wait (before its lease)
      every keepalive_s         the head once (with the surface's opening, Anthropic's
                                message_start), then one keepalive frame
    answered()                  the first upstream chunk is in: no keepalive byte is written
                                after this (called synchronously before the relay writes, so a
                                frame never lands inside the answer's bytes)
    close()                     the request ended however it ended: the timer's task is gone

A keepalive is not content: a route may still hand the request on to its next slot (the head is
out, the next slot's answer follows it). Once the head is out, what would have been an error
status is the surface's terminal error frame instead (path.Dispatch.serve).

A timer per stream, and a task only once it fires: a request answered within keepalive_s costs
one timer that never fires.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from hal0d.forward.exchange import Exchange
from hal0d.logs import get_logger

log = get_logger()


class Waiting:
    """One streamed request's wait for its answer's first byte, told to its client."""

    __slots__ = ("_answered", "_lock", "_relaying", "_task", "_timer", "bound_s", "every_s",
                 "exchange", "on_sent", "request", "response", "sent", "what")

    def __init__(self, request: web.Request, exchange: Exchange, *, every_s: float,
                 bound_s: float, what: Callable[[], str],
                 on_sent: Callable[[str], None] | None = None) -> None:
        self.request = request
        self.exchange = exchange
        self.every_s = every_s  # the slot's keepalive_s (a route's next slot may set another)
        self.bound_s = bound_s  # how long one write may wait for the client (stallguard's)
        self.what = what  # what the request waits for now, in words
        self.on_sent = on_sent
        # The response whose head is out: the early head this sent, or the relay's own once it
        # began (the keepalive then goes on in it until the first chunk).
        self.response: web.StreamResponse | None = None
        self.sent = 0
        self._answered = False
        self._relaying = False  # the relay makes the head: this makes none of its own
        self._lock = asyncio.Lock()  # one write at a time: a head is never written twice
        self._task: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """The first keepalive is due `every_s` from now: a timer, not a task, so a request
        answered sooner costs one timer that never fires."""
        if self.every_s > 0 and self._task is None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.every_s, self._due)

    def _due(self) -> None:
        self._timer = None
        if not self._answered:
            self._task = asyncio.get_running_loop().create_task(self._run())

    @property
    def head_sent(self) -> bool:
        return self.response is not None

    async def relay_head(self) -> web.StreamResponse | None:
        """The relay is about to begin: the early head's response when it is out (after the
        write in flight, if any), else None, and from now on this writes no head of its own
        (the relay's goes out, then `adopt`)."""
        async with self._lock:
            self._relaying = True
            return self.response

    def adopt(self, response: web.StreamResponse) -> None:
        """The relay's response, its head out: keepalives until the first chunk go into it."""
        self.response = response

    def answered(self) -> None:
        """The upstream's first chunk is in: nothing more is written here. Synchronous, called
        before the relay writes the chunk: a write already begun has put its whole frame into
        the transport, and no other starts."""
        self._answered = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def close(self) -> None:
        self.answered()

    async def _run(self) -> None:
        """Each keepalive, every `every_s`, until the first chunk (answered cancels this)."""
        while await self._send():  # noqa: ASYNC110 (a period between frames, not a poll)
            await asyncio.sleep(self.every_s)

    async def _send(self) -> bool:
        """One keepalive (the head first, when it is not out); False when the client is gone or
        takes nothing within the bound (its connection is then cut, as the stall guard cuts a
        relayed stream's)."""
        exchange = self.exchange
        async with self._lock:
            if self._answered:
                return False
            try:
                async with asyncio.timeout(self.bound_s or None):
                    if self.response is None:
                        if self._relaying:
                            return True  # the relay's head is on its way: the next time
                        response = web.StreamResponse(status=200, headers=exchange.head())
                        await response.prepare(self.request)
                        self.response = response
                    await self.response.write(exchange.keepalive(self.what()))
            except (ConnectionResetError, TimeoutError):
                if self.request.transport is not None:
                    self.request.transport.abort()
                return False
        self.sent += 1
        if self.on_sent is not None:
            self.on_sent(exchange.surface)
        return True
