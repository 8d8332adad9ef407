"""Errors hal0d answers with, and the envelopes they are rendered in (OpenAI's and Anthropic's
below; on the Ollama API every one is Ollama's `{"error": message}` with the same status).

    Hal0Error                      status  OpenAI type / code                       Anthropic type
     ├── InvalidRequest            400     invalid_request_error / request.invalid  invalid_request_error
     │    └── ContextExceeded      400     invalid_request_error / context_length_exceeded  invalid_request_error
     ├── Unauthorized              401     authentication_error / auth.invalid_key  authentication_error
     ├── Forbidden                 403     permission_error / access.forbidden      permission_error
     ├── NoRoute                   404     not_found_error / dispatch.no_route      not_found_error
     ├── MethodNotAllowed          405     invalid_request_error / request.method   invalid_request_error
     ├── Conflict                  409     invalid_request_error / slot.conflict    invalid_request_error
     ├── PayloadTooLarge           413     invalid_request_error / request.too_large request_too_large
     ├── QueueFull                 429     rate_limit_error / slot.queue_full       rate_limit_error
     ├── KeyLimited                429     rate_limit_error / access.key_limited    rate_limit_error
     │    └── QuotaExceeded        429     insufficient_quota / access.quota_exceeded  rate_limit_error
     ├── SlotLoading               503     slot_loading / slot.loading              overloaded_error
     ├── SlotLoadFailed            503     slot_load_failed / slot.load_failed      overloaded_error
     ├── FdExhausted               503     server_overloaded / server.fd_exhausted  overloaded_error
     ├── UpstreamUnavailable       502     upstream_unavailable / dispatch.upstream_unavailable  api_error
     │    └── UpstreamInvalid      502     upstream_invalid / dispatch.upstream_invalid  api_error
     └── UpstreamStatus            (the upstream's status, its message kept)        by status

Foreign exceptions (aiohttp's client errors, asyncio timeouts) are translated into this tree only
at the upstream boundary (failures.py); handlers catch Hal0Error and render it for their surface.
A message is read by every user of a client (a chat front end shows it on its page): it names the
slot and the cause, never an upstream's address, which is for the log and the operator's views
(the boundary words the cause without it; `without_address` takes it out of a slot's reason).

How a request ended badly is recorded as one ErrorCode (the history's error_code column, the
`outcome` label of hal0d_requests_total, the request.done line). A Hal0Error's `error_code` is the
last part of its envelope `code` (`dispatch.upstream_unavailable` is recorded as
`upstream_unavailable`); the other codes name what happened to a stream. Two are built from a
prefix: `upstream_status_<status>` (upstream_status()) and `stream_stall_<reason>`
(stream_stall()).
"""

from __future__ import annotations

import re
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit


class ErrorCode(StrEnum):
    """Every error_code a request can be recorded with; the values are what the history and
    /metrics show, so they never change."""

    # The client's side of a stream.
    CLIENT_DISCONNECT = "client_disconnect"
    CLIENT_STALLED = "client_stalled"  # took no bytes for too long, cut by the stall guard
    # The upstream's side.
    UPSTREAM_UNAVAILABLE = "upstream_unavailable"
    UPSTREAM_INVALID = "upstream_invalid"
    UPSTREAM_BROKEN = "upstream_broken"
    UPSTREAM_INCOMPLETE = "upstream_incomplete"
    UPSTREAM_MALFORMED = "upstream_malformed"
    UPSTREAM_STATUS = "upstream_status_"  # prefix: upstream_status(status)
    STREAM_STALL = "stream_stall_"  # prefix: stream_stall(reason)
    # Refused by hal0d (a Hal0Error).
    INVALID = "invalid"
    CONTEXT_EXCEEDED = "context_exceeded"  # the prompt (and max_tokens) past the context
    INVALID_KEY = "invalid_key"
    FORBIDDEN = "forbidden"
    NO_ROUTE = "no_route"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    CONFLICT = "conflict"
    TOO_LARGE = "too_large"
    QUEUE_FULL = "queue_full"
    KEY_LIMITED = "key_limited"
    QUOTA_EXCEEDED = "quota_exceeded"  # a key past its tokens_per_hour or tokens_per_day
    LOADING = "loading"
    LOAD_FAILED = "load_failed"
    FD_EXHAUSTED = "fd_exhausted"
    INTERNAL = "internal"


def upstream_status(status: int) -> str:
    """The code of a request the upstream answered with an error status."""
    return f"{ErrorCode.UPSTREAM_STATUS}{status}"


def stream_stall(reason: str) -> str:
    """The code of a stream the stall guard ended (reason: total, idle, read, shutdown,
    unloaded)."""
    return f"{ErrorCode.STREAM_STALL}{reason}"


def stall_reason(error_code: str | None) -> str | None:
    """The stall guard's reason when `error_code` is a stream_stall() code, else None."""
    if error_code is None or not error_code.startswith(ErrorCode.STREAM_STALL):
        return None
    return error_code.removeprefix(ErrorCode.STREAM_STALL)


class Hal0Error(Exception):
    status = 500
    openai_type = "internal_error"
    code = "internal"
    error_code: str = ErrorCode.INTERNAL
    anthropic_type = "api_error"

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.retry_after = retry_after

    def openai_body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.openai_type,
                "code": self.code,
                "param": self.field,
            }
        }

    def anthropic_body(self) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}

    def ollama_body(self) -> dict[str, Any]:
        return {"error": self.message}

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class InvalidRequest(Hal0Error):
    status = 400
    openai_type = "invalid_request_error"
    code = "request.invalid"
    error_code = ErrorCode.INVALID
    anthropic_type = "invalid_request_error"


class ContextExceeded(InvalidRequest):
    """The prompt, with the answer's max_tokens, does not fit the model's context: refused in
    the words each client acts on (the openai SDK and Codex read `context_length_exceeded`,
    Claude Code compacts on "prompt is too long")."""

    code = "context_length_exceeded"
    error_code = ErrorCode.CONTEXT_EXCEEDED

    def __init__(self, prompt_tokens: int, context: int, max_tokens: int | None = None) -> None:
        self.prompt_tokens, self.context, self.max_tokens = prompt_tokens, context, max_tokens
        message = (f"This model's maximum context length is {context} tokens. However, your "
                   f"messages resulted in {prompt_tokens} tokens")
        if max_tokens:
            message += (f" ({prompt_tokens + max_tokens} with the {max_tokens} of max_tokens "
                        "for the answer)")
        super().__init__(message + ". Please reduce the length of the messages.",
                         field="messages")

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's own two messages: the prompt alone too long, or with max_tokens."""
        if self.prompt_tokens > self.context or not self.max_tokens:
            message = f"prompt is too long: {self.prompt_tokens} tokens > {self.context} maximum"
        else:
            message = (f"input length and `max_tokens` exceed context limit: "
                       f"{self.prompt_tokens} + {self.max_tokens} > {self.context}, decrease "
                       "input length or `max_tokens` and try again")
        return {"type": "error", "error": {"type": self.anthropic_type, "message": message}}


class Unauthorized(Hal0Error):
    status = 401
    openai_type = "authentication_error"
    code = "auth.invalid_key"
    error_code = ErrorCode.INVALID_KEY
    anthropic_type = "authentication_error"


class Forbidden(Hal0Error):
    status = 403
    openai_type = "permission_error"
    code = "access.forbidden"
    error_code = ErrorCode.FORBIDDEN
    anthropic_type = "permission_error"


class NoRoute(Hal0Error):
    status = 404
    openai_type = "not_found_error"
    code = "dispatch.no_route"
    error_code = ErrorCode.NO_ROUTE
    anthropic_type = "not_found_error"


class MethodNotAllowed(Hal0Error):
    status = 405
    openai_type = "invalid_request_error"
    code = "request.method_not_allowed"
    error_code = ErrorCode.METHOD_NOT_ALLOWED
    anthropic_type = "invalid_request_error"


class Conflict(Hal0Error):
    """The request does not fit the slot's state: unloading a slot with requests queued, loading
    one hal0d does not start."""

    status = 409
    openai_type = "invalid_request_error"
    code = "slot.conflict"
    error_code = ErrorCode.CONFLICT
    anthropic_type = "invalid_request_error"


class PayloadTooLarge(Hal0Error):
    status = 413
    openai_type = "invalid_request_error"
    code = "request.too_large"
    error_code = ErrorCode.TOO_LARGE
    anthropic_type = "request_too_large"


class QueueFull(Hal0Error):
    status = 429
    openai_type = "rate_limit_error"
    code = "slot.queue_full"
    error_code = ErrorCode.QUEUE_FULL
    anthropic_type = "rate_limit_error"


class KeyLimited(Hal0Error):
    """The request's key is at its max_concurrent or requests_per_minute ([[keys]])."""

    status = 429
    openai_type = "rate_limit_error"
    code = "access.key_limited"
    error_code = ErrorCode.KEY_LIMITED
    anthropic_type = "rate_limit_error"


class QuotaExceeded(KeyLimited):
    """The request's key used its tokens_per_hour or tokens_per_day ([[keys]]): Retry-After is
    when that window resets (OpenAI's own type for a used-up quota; its SDKs raise their rate
    limit error on the 429)."""

    openai_type = "insufficient_quota"
    code = "access.quota_exceeded"
    error_code = ErrorCode.QUOTA_EXCEEDED


class SlotLoading(Hal0Error):
    status = 503
    openai_type = "slot_loading"
    code = "slot.loading"
    error_code = ErrorCode.LOADING
    anthropic_type = "overloaded_error"


class SlotLoadFailed(Hal0Error):
    """The slot's model could not be loaded (its process exited, or did not answer within
    load_timeout_s, or its group had no room); the message says why."""

    status = 503
    openai_type = "slot_load_failed"
    code = "slot.load_failed"
    error_code = ErrorCode.LOAD_FAILED
    anthropic_type = "overloaded_error"


class FdExhausted(Hal0Error):
    """hal0d ran out of file descriptors opening a socket for the request (EMFILE, ENFILE):
    its own capacity failed, not the upstream, so a 503 to retry rather than a 502."""

    status = 503
    openai_type = "server_overloaded"
    code = "server.fd_exhausted"
    error_code = ErrorCode.FD_EXHAUSTED
    anthropic_type = "overloaded_error"


class UpstreamUnavailable(Hal0Error):
    status = 502
    openai_type = "upstream_unavailable"
    code = "dispatch.upstream_unavailable"
    error_code = ErrorCode.UPSTREAM_UNAVAILABLE
    anthropic_type = "api_error"
    # Why, in a few words for a log line or a slot's reason ("cannot connect (...)"); set by
    # the transport's mapping (failures.upstream_errors), None where there is none.
    cause: str | None = None
    # The same as one stable word (connect_refused, connect_failed, timeout, disconnected,
    # unavailable): a route's hand-on reason.
    kind: str = "unavailable"


class UpstreamInvalid(UpstreamUnavailable):
    """The upstream answered, but not with anything usable (an empty body, a wrong content-type)."""

    openai_type = "upstream_invalid"
    code = "dispatch.upstream_invalid"
    error_code = ErrorCode.UPSTREAM_INVALID


class UpstreamStatus(Hal0Error):
    """The upstream answered with an error status; its message is kept.

    Only the Anthropic surface raises this: the OpenAI surface relays upstream errors verbatim.
    """

    openai_type = "upstream_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = self.error_code = upstream_status(status)
        self.anthropic_type = anthropic_type_for_status(status)


def anthropic_type_for_status(status: int) -> str:
    if status in (503, 529):
        return "overloaded_error"
    return {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
        429: "rate_limit_error",
    }.get(status, "api_error")


def upstream_message(body: object) -> str | None:
    """The message of an upstream's error body, however the server shapes it:
    `{"error": {"message": ...}}` (OpenAI), `{"error": "..."}` or `{"message": ...}`."""
    if not isinstance(body, dict):
        return None
    error = body.get("error")
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    if isinstance(error, str):
        return error
    message = body.get("message")
    return message if isinstance(message, str) else None


# What stands in a client's message for an upstream's address.
ADDRESS_SHOWN = "[upstream]"


def without_address(text: str, upstream: str) -> str:
    """`text` (a slot's reason: a probe's words, its process's last lines) with the address of
    `upstream` (its URL, its host:port) put as ADDRESS_SHOWN, for a client's message; the log
    and the operator's views keep the text as it is. A host alone (a URL without a port) is
    left: it may be a word of the text as well."""
    parts = urlsplit(upstream)
    forms = {upstream.rstrip("/")}
    if parts.port is not None:
        forms |= {parts.netloc.rpartition("@")[2], f"{parts.hostname}:{parts.port}",
                  f"hostname: {parts.hostname}, port: {parts.port}"}  # llama-server's words
    named = "|".join(re.escape(form) for form in sorted(forms, key=len, reverse=True))
    return re.sub(f"(?:{named})(?![0-9])", ADDRESS_SHOWN, text)
