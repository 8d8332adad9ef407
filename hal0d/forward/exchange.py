"""The exchange: a surface's whole say in how its request meets an upstream.

A handler parses and validates its request and builds one Exchange; the forward path runs it on
each slot of the route's plan (attempt.py) and is the only code that touches the upstream's
answer. Per slot, the forward path calls, in this order:

    prepare(route)          before the lease: the surface's own checks for this slot (a request
                            to translate is parsed whole, so a bad one is a 400 before any wait)
    unleased(fwd)           an answer that needs no lease (so loads nothing), or None
    await call(fwd)         under the lease: what to send (a Call: path, body, ...), or an answer
                            made without the upstream (a token count, an Ollama load)
    (the forward path opens the upstream and classifies its answer: status, content type)
    refused(answer, data)   an error status read whole: the surface's own error to raise, or
                            None to pass the upstream's answer on as it came (by default: an
                            upstream's own context error is ContextExceeded, in every surface's
                            words; anything else as it came)
    whole(answer, data)     a whole answer (also a stream's non-200 answer, and the answer of an
                            upstream that did not stream on a surface that relays as it came)
    relay(answer)           a stream: the response's headers and the Transform of its body
    relayed(transform)      after the stream, on every exit: what the surface keeps of it

The defaults pass the upstream's answer through as it came, so the OpenAI surface is the base
class with a body; a translating surface overrides what it rebuilds in its own shapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import hdrs, web
from multidict import CIMultiDictProxy

from hal0d.config import SlotConfig
from hal0d.errors import ContextExceeded, Hal0Error, UpstreamStatus, upstream_message
from hal0d.forward.context_guard import ContextNeed
from hal0d.observability.requestinfo import RequestInfo
from hal0d.protocol.context_errors import context_exceeded
from hal0d.protocol.sse import comment
from hal0d.protocol.transform import Transform
from hal0d.routing import Route
from hal0d.transport.tap import normal_usage
from hal0d.transport.upstream import SSE_HEADERS, response_headers

__all__ = ["Answer", "Attempt", "Call", "Exchange", "context_refusal", "upstream_refusal"]

UPSTREAM_MESSAGE_LIMIT = 2000


class Attempt(Protocol):
    """What an exchange's hooks are handed of the request's way to one slot (attempt.Forward)."""

    route: Route
    request: web.Request
    info: RequestInfo

    @property
    def slot(self) -> SlotConfig: ...

    @property
    def warm(self) -> bool:
        """The slot answers without a load (its lease would not start or swap anything)."""
        ...

    async def count_tokens(self, openai_request: dict[str, Any], text: str
                           ) -> tuple[int, str]: ...

    async def anthropic_mode(self) -> str: ...

    async def responses_mode(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Call:
    """What one slot's upstream is sent. `json_body`: say the body is JSON, whatever the client
    said. `answered_by`: the exchange that shapes this call's answer when it is not the one that
    made it (a surface whose slot turned out to serve it natively)."""

    path: str
    body: bytes
    params: Any = None
    method: str = hdrs.METH_POST
    json_body: bool = True
    answered_by: Exchange | None = None


@dataclass(frozen=True, slots=True)
class Answer:
    """The head of the upstream's answer, as the exchange's hooks see it."""

    status: int
    content_type: str
    headers: CIMultiDictProxy[str]
    slot: str  # the slot's name, for the surface's messages

    def json(self, data: bytes) -> Any:
        """The body as JSON when the upstream said it is, else None (unreadable included)."""
        if self.content_type != "application/json":
            return None
        try:
            return orjson.loads(data)
        except orjson.JSONDecodeError:
            return None


class Exchange:
    """One request's way to meet an upstream (see the module's docstring). `stream`: the client
    asked for a stream. `sse`: a stream's answer must be text/event-stream (an audio stream is
    any bytes). `translated`: the answer is rebuilt in the surface's own shapes, so a streamed
    request whose upstream answered with something else is an error (UpstreamInvalid), where a
    surface that relays as it came passes that answer on and records the failure.
    `empty_ok`: a 200 with an empty body is an answer (a stored response's HEAD or DELETE)."""

    stream: bool = False
    sse: bool = True
    translated: bool = False
    empty_ok: bool = False
    surface: str = "openai"  # the hal0d_keepalives_total label

    # While a stream waits for its first byte (keepalive.py): the head, the keepalive, and
    # the end of a stream whose head is out but whose answer failed. The defaults are the
    # OpenAI surfaces' (chat, completions, Responses).
    @property
    def keeps_alive(self) -> bool:
        """Whether the stream has frames a keepalive can go between (an audio stream has not)."""
        return self.stream and self.sse

    def head(self) -> Mapping[str, str]:
        return SSE_HEADERS

    def keepalive(self, what: str) -> bytes:
        """An SSE comment, which every SSE client skips, naming what the request waits for."""
        return comment(f"hal0d: {what}")

    def failed(self, error: Hal0Error) -> bytes:
        """The stream's last frame when its answer failed after the head went out: the error
        event the OpenAI SDK raises on, in the envelope a status would have carried."""
        return b"data: " + orjson.dumps(error.openai_body()) + b"\n\n"

    def prepare(self, route: Route) -> None:
        """Before the slot's lease is taken: what the surface must check for this slot."""

    def unleased(self, fwd: Attempt) -> web.StreamResponse | None:
        """An answer given without taking the slot, so without loading it (a token count for a
        model that is not loaded, an unload asked of one that is not), or None to take it."""
        return None

    def need(self) -> ContextNeed | None:
        """What the request needs of the slot's context, measured before the lease
        (context_guard.py); None: not a generation the guard measures."""
        return None

    async def call(self, fwd: Attempt) -> Call | web.StreamResponse:
        raise NotImplementedError

    def refused(self, answer: Answer, data: bytes) -> Hal0Error | None:
        """An error status (>= 400), its body read whole: the error the client gets in the
        surface's envelope, or None for the upstream's answer as it came."""
        return context_refusal(answer, data)

    def whole(self, fwd: Attempt, answer: Answer, data: bytes) -> web.StreamResponse:
        """A whole answer, passed on as it came; its usage noted when it has one."""
        if b'"usage"' in data:
            parsed = answer.json(data)
            if isinstance(parsed, dict) and isinstance(parsed.get("usage"), dict):
                fwd.info.apply_usage(normal_usage(parsed["usage"]), parsed.get("timings"))
        return web.Response(body=data, status=answer.status,
                            headers=response_headers(answer.headers))

    def relay(self, fwd: Attempt, answer: Answer) -> tuple[Mapping[str, str], Transform]:
        """A stream's response headers and the transform its body goes through."""
        raise NotImplementedError

    def relayed(self, fwd: Attempt, transform: Transform) -> None:
        """After a stream, on every exit: what the surface keeps of it."""


def context_refusal(answer: Answer, data: bytes) -> ContextExceeded | None:
    """The upstream's 400 saying the prompt does not fit its context (its own count, where
    hal0d's estimate let the request through), as hal0d's ContextExceeded; else None."""
    return context_exceeded(data) if answer.status == 400 else None


def upstream_refusal(answer: Answer, data: bytes) -> Hal0Error:
    """The upstream's error status and its message, for a surface that answers errors in its own
    envelope (Anthropic's, Ollama's) rather than the upstream's as it came; its context error
    as ContextExceeded."""
    if (exceeded := context_refusal(answer, data)) is not None:
        return exceeded
    try:
        message = upstream_message(orjson.loads(data))
    except orjson.JSONDecodeError:
        message = None
    if message is None:
        message = data.decode("utf-8", "replace").strip()
    # Some servers put their Python traceback in the message; the client gets the message only.
    message = message.split('\n  File "', 1)[0].strip()
    message = message[:UPSTREAM_MESSAGE_LIMIT] or f"upstream answered {answer.status}"
    return UpstreamStatus(answer.status, f"slot {answer.slot!r}: {message}")

