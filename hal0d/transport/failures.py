"""What hal0d makes of a call to an upstream that failed, and the one module that names aiohttp's
client exceptions: each failure becomes hal0d's own error (`upstream_errors`), except a request
that a kept-alive connection lost before any answer, which is sent once more on a fresh
connection (`retry_on_fresh`, the session's middleware). The client that makes the calls and
the session they go through are upstream.py's.

aiohttp's exceptions stop here, mapped in one place (`upstream_errors`, after httpcore's
`map_exceptions`): a failure to get an answer at all (a refused connect, a timeout, a reset, a
broken framing) becomes UpstreamUnavailable, a clean 502 before the client response has started,
never a torn stream, its message naming the slot and the cause but no address (transport_reason;
the log line has it); a socket hal0d cannot open because it has no descriptor left (EMFILE,
ENFILE) becomes FdExhausted (503, see descriptors.py): hal0d's capacity failed, not the upstream.
The one exception is the relay's loop (relay.py), where the client response has started and a
break is an outcome written into the stream rather than an error status.

Kept-alive connections. A request that a kept-alive connection fails before any byte of an
answer (the server closed it as it was taken from the pool, or reset it; or what came first was
not an answer's status line: bytes the server sent after its last answer) is sent again, once,
on a fresh connection (`retry_on_fresh`). Nothing has reached the client, the body is in
memory, and nothing of an answer was read; any other failure, and any failure of a fresh
connection, is the request's. A retry that cannot connect at all fails the request with the
first failure: the upstream went away after it took the request, which is no refused connect
(one that reads as "nothing was sent"). An idle connection that receives bytes is closed by
aiohttp on their arrival; the retry covers the bytes that arrive after the connection was taken
again. So a request can reach an upstream twice, the first time on a spoiled connection, which
hal0d closes (llama-server stops what it started of a request whose connection closes).
"""

from __future__ import annotations

import errno
import os
import weakref
from types import TracebackType

import aiohttp
from aiohttp import ClientHandlerType
from aiohttp.client_proto import ResponseHandler
from aiohttp.http_exceptions import BadStatusLine

from hal0d.config import SlotConfig
from hal0d.errors import UpstreamUnavailable, without_address
from hal0d.logs import get_logger
from hal0d.transport.descriptors import exhausted, exhaustion_errno

log = get_logger()

# What a call to an upstream raises when it gets no usable answer, and nothing else: aiohttp's
# client errors (they wrap the socket's OSErrors; InvalidURL is one; ServerTimeoutError is a
# TimeoutError too), asyncio's timeouts, and a connection reset the transport reports as it is.
# A bug of hal0d's (a ValueError, an OSError of a file) is not in here: it must not read as a
# 502 from the upstream.
TRANSPORT_ERRORS: tuple[type[Exception], ...] = (
    TimeoutError,
    aiohttp.ClientError,
    ConnectionError,
)

# The transport errors a relayed body's read can raise, named here so that every aiohttp error
# hal0d knows is classified in this module: the relay catches them by these names.
BODY_READ_TIMEOUT: type[Exception] = aiohttp.ServerTimeoutError  # with both guard bounds off
BODY_BROKEN: tuple[type[Exception], ...] = (aiohttp.ClientPayloadError,
                                            aiohttp.ClientConnectionError)


def transport_reason(exc: BaseException, during: str) -> str:
    """Why a call to an upstream got no answer, in words for a client's message and a slot's
    reason (`during`: what it waited for, as in "timed out <during>"): from the exception's type
    and errno, never its text, which names the address ("Cannot connect to host 127.0.0.1:8080",
    "Connect call failed ('127.0.0.1', 8080)"): only the log line has that (upstream_errors)."""
    if isinstance(exc, WriteTimeout):
        return "timed out sending the request"
    if isinstance(exc, TimeoutError):
        return f"timed out {during}"
    if isinstance(exc, aiohttp.ClientSSLError):  # its errno is OpenSSL's, not the OS's
        return "cannot connect (TLS handshake failed)"
    if isinstance(exc, aiohttp.ClientConnectorDNSError):
        return "cannot connect (name not resolved)"
    if isinstance(exc, aiohttp.ClientConnectorError):
        words = _errno_words(exc.os_error.errno)
        return f"cannot connect ({words})" if words else "cannot connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return f"connection closed {during}"
    if isinstance(exc, ConnectionResetError):
        return f"connection reset {during}"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return f"incomplete body {during}"
    if isinstance(exc, aiohttp.ClientResponseError):
        return f"invalid answer {during}"
    if isinstance(exc, aiohttp.InvalidURL):
        return "invalid upstream URL"
    words = _errno_words(exc.errno) if isinstance(exc, OSError) else None
    return f"{words or type(exc).__name__} {during}"


def _errno_words(code: int | None) -> str | None:
    """The OS's words for an errno ("connection refused"), which name no address."""
    if code is None or code <= 0:  # none, or a resolver's (negative) code
        return None
    words = os.strerror(code)
    return words[:1].lower() + words[1:]


def transport_kind(exc: BaseException) -> str:
    """transport_reason as one stable word (UpstreamUnavailable.kind)."""
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError):
        refused = exc.os_error.errno == errno.ECONNREFUSED
        return "connect_refused" if refused else "connect_failed"
    if isinstance(exc, aiohttp.ServerDisconnectedError | ConnectionResetError):
        return "disconnected"
    return "unavailable"


class upstream_errors:  # lower case: read as a `with` statement, as contextlib's helpers are
    """`with upstream_errors(slot, during):` maps the transport exceptions raised inside it to
    hal0d's error tree, the one place that does (as httpcore's `map_exceptions` does):

        no descriptor left (EMFILE, ENFILE)  FdExhausted, when `refused_at` names the request's
                                             step for the descriptors report; else as below
        any other of TRANSPORT_ERRORS        UpstreamUnavailable naming the slot and the reason

    `slot_reason`: why the slot is in error, if it is (a lease is granted in error, as the probe
    may be stale); the message names it, since "cannot connect" alone hides the cause (a process
    that could not be started). Everything else (CancelledError above all) passes untouched.
    The message is a client's and names no address (transport_reason); `logged`: a forwarded
    request's failure, logged here as `upstream.unavailable` with the upstream and the
    exception's own text (hal0d's own questions, a probe every few milliseconds while a model
    loads, are told by their callers).
    """

    __slots__ = ("during", "logged", "refused_at", "slot", "slot_reason")

    def __init__(
        self,
        slot: SlotConfig,
        during: str,
        *,
        refused_at: str | None = None,
        slot_reason: str | None = None,
        logged: bool = False,
    ) -> None:
        self.slot = slot
        self.during = during
        self.refused_at = refused_at
        self.slot_reason = slot_reason
        self.logged = logged

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None or not isinstance(exc, TRANSPORT_ERRORS):
            return
        slot = self.slot
        if self.refused_at is not None and (code := exhaustion_errno(exc)) is not None:
            # hal0d's own capacity failed, not the upstream: a 503 to retry, not a 502.
            raise exhausted(
                code, self.refused_at, f"reach slot {slot.name!r}"
            ) from None
        cause = transport_reason(exc, self.during)
        if self.logged:  # the operator's words (info: a failing slot's warning is cooldown.py's)
            log.info("upstream.unavailable", slot=slot.name, upstream=slot.upstream,
                        reason=cause, error=f"{type(exc).__name__}: {exc}".removesuffix(": "))
        reason = cause
        if self.slot_reason:
            reason += f"; the slot is in error: {without_address(self.slot_reason, slot.upstream)}"
        error = UpstreamUnavailable(f"slot {slot.name!r} is unavailable: {reason}")
        error.cause = cause
        error.kind = transport_kind(exc)
        raise error from None


# Raised by the body writer (upstream.py's _Body); defined here, as it is one of aiohttp's
# exceptions (a ServerTimeoutError: aiohttp's writer hands it on as it is) and
# transport_reason words it apart from the other timeouts.
class WriteTimeout(aiohttp.ServerTimeoutError):
    """The upstream took no part of the request's body for write_timeout_s."""


# The connections that have carried a request: the next request on one of them is on a
# kept-alive connection. Weak: a closed connection's protocol goes with it.
_carried: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()


class _Stale(Exception):
    """A retry was handed a kept-alive connection; it is closed unused (aiohttp closes a
    connection its request failed on) and the pool asked again."""


class UpstreamRequest(aiohttp.ClientRequest):
    """aiohttp's request, knowing whether it went out on a kept-alive connection (`reused`), and,
    as a retry (`fresh`), refusing one before a byte of it is written."""

    reused = False
    fresh = False

    async def send(self, conn: aiohttp.connector.Connection) -> aiohttp.ClientResponse:
        protocol = conn.protocol
        assert protocol is not None, "a connection handed to a request is open"
        self.reused = protocol in _carried
        if self.reused and self.fresh:
            raise _Stale
        _carried.add(protocol)
        return await super().send(conn)


def stale_connection(exc: BaseException) -> str | None:
    """Why a request on a kept-alive connection failed because of the connection, before any
    answer: a stable word, or None when the failure is the request's (a timeout, an answer with
    a broken head, a connect that failed: that one had no kept-alive connection)."""
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "disconnected"  # closed by the server as the pool handed it out
    if isinstance(exc, aiohttp.ClientOSError) and not isinstance(exc, aiohttp.ClientConnectorError):
        return "reset"
    if isinstance(exc, aiohttp.ClientResponseError):
        # What came first was not a status line: bytes the server sent after its last answer.
        seen: set[int] = set()
        cause: BaseException | None = exc.__cause__
        while cause is not None and id(cause) not in seen:
            if isinstance(cause, BadStatusLine):
                return "not_an_answer"
            seen.add(id(cause))
            cause = cause.__cause__
    return None


async def retry_on_fresh(request: aiohttp.ClientRequest,
                         handler: ClientHandlerType) -> aiohttp.ClientResponse:
    """The session's middleware: a request a kept-alive connection failed before any answer
    (stale_connection) is sent again, once, on a fresh connection (the module's docstring).
    Within the request's own bounds: the open's timer runs on."""
    if not isinstance(request, UpstreamRequest):
        return await handler(request)
    try:
        return await handler(request)
    except aiohttp.ClientError as exc:
        reason = stale_connection(exc)
        if reason is None or not request.reused:
            raise
        log.info("upstream.retried", upstream=str(request.url.origin()), reason=reason)
        first = exc
    request.fresh = True
    while True:
        try:
            return await handler(request)
        except _Stale:
            # Idle as long as the one that failed, it may be as spoiled (a server that closes
            # idle connections closes them all): closed unused, and the pool asked again until
            # it connects anew.
            continue
        except aiohttp.ClientConnectorError:
            # No connection at all: the upstream went away after it took the request (a
            # process that died of it). The request's failure is that one, not a connect
            # refused before anything was sent, which would read as safe to send again.
            raise first from None
