"""Access control: whether a request may come in at all (its Host and its Origin), which requests
need a key, and whether the one they carry is accepted.

A web page the same person opens in a browser can send requests to 127.0.0.1 (a form or a
`text/plain` fetch needs no CORS preflight), and a DNS-rebinding page (its own name resolving to
127.0.0.1) is even same-origin to the browser. So before anything else:

* Host: a loopback name or address (`localhost`, `*.localhost`, `127.0.0.1`, `[::1]`), the
  address hal0d listens on (any IP address when it listens on all of them: an IP literal cannot
  be rebound), or a name in `[server] allowed_hosts`; anything else is 403 (`server.host_refused`,
  logged once per host a minute). A rebinding page's Host is its own name: refused.
* Origin: a request that carries one (browsers do; curl, the SDKs and agents do not) must come
  from hal0d's own origin (the scheme and Host it was reached on) or `[server] allowed_origins`;
  anything else is 403 on every method and path. An allowed foreign origin gets CORS answers
  (a preflight, `Access-Control-Allow-Origin` naming it alone); any other gets no CORS header.

Then the key (hal0d.keys: which scope a path needs, what each key may do), or, for a request
that carries none, the anonymous access of the listener it came in on (by its port), for the
source addresses that table names. /healthz and /readyz never need one: a load balancer's or
systemd's probe carries no key. /readyz shows the slots' reasons only to a key holder when keys
are set (may_see_details).
"""

from __future__ import annotations

import functools
import ipaddress
import time
from typing import Final

from aiohttp import hdrs, web

from hal0d.config import ServerConfig, is_loopback
from hal0d.errors import Forbidden, Unauthorized
from hal0d.keys import ADMIN, INFERENCE, READ, Key, KeyRing
from hal0d.logs import get_logger

log = get_logger()


def presented_key(request: web.Request) -> str | None:
    """`Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients)."""
    authorization = request.headers.get(hdrs.AUTHORIZATION, "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


# What a CORS preflight from an allowed origin is told: the API's methods, and the request's own
# headers (Authorization, x-api-key, anthropic-version, the SDKs' x-stainless-*), for ten minutes.
CORS_METHODS: Final = "GET, POST, DELETE, OPTIONS"
CORS_MAX_AGE_S: Final = "600"
CORS_EXPOSED: Final = "X-Request-Id, Retry-After"
REFUSAL_LOG_EVERY_S: Final = 60.0
_MAX_REMEMBERED_HOSTS: Final = 1024
_host_logged: dict[str, float] = {}
WILDCARD_HOSTS: Final = frozenset({"0.0.0.0", "::", ""})


def host_name(host: str) -> str:
    """The name in a Host header, without its port, lower-cased (`[::1]:8080` -> `::1`)."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        return host.partition(":")[0]
    return host


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def host_allowed(host: str | None, server: ServerConfig, listening: str | None = None) -> bool:
    """`listening`: the address of the listener the request came in on ([server].host's when
    None; the Ollama listener has its own)."""
    if host is None:
        return True  # HTTP/1.0 without Host: no browser sends that
    listening = server.host if listening is None else listening
    return _name_allowed(host_name(host), listening.strip("[]").lower(), server.allowed_hosts)


@functools.lru_cache(maxsize=256)
def _name_allowed(name: str, listening: str, allowed: tuple[str, ...]) -> bool:
    """Cached: a box is reached by a few names, and parsing an address costs more than the
    lookup (a client that makes up names only churns the bounded cache)."""
    if is_loopback(name) or name.endswith(".localhost") or name in allowed:
        return True
    if listening in WILDCARD_HOSTS:
        return is_ip(name)
    return name == listening


def own_origin(request: web.Request) -> str:
    return f"{request.scheme}://{request.headers.get(hdrs.HOST, '')}".lower()


def origin_allowed(origin: str, request: web.Request, server: ServerConfig) -> bool:
    origin = origin.strip().rstrip("/").lower()
    return origin == own_origin(request) or origin in server.allowed_origins


def cross_origin(request: web.Request, server: ServerConfig) -> str | None:
    """The request's Origin when it is an allowed foreign one (CORS headers are due), else
    None (no Origin, hal0d's own, or one not allowed)."""
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is None or origin.strip().rstrip("/").lower() not in server.allowed_origins:
        return None
    return origin


def _refuse_host(host: str) -> Forbidden:
    now = time.monotonic()
    if now - _host_logged.get(host, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
        if len(_host_logged) >= _MAX_REMEMBERED_HOSTS:
            _host_logged.clear()
        _host_logged[host] = now
        log.warning("server.host_refused", host=host,
                    hint="add it to [server] allowed_hosts if it is yours")
    return Forbidden(f"Host {host!r} is not one hal0d answers: it serves loopback names, the "
                     "address it listens on and [server] allowed_hosts (a web page that "
                     "rebinds its name to this machine sends its own)")


def admit(request: web.Request, server: ServerConfig, listening: str | None = None) -> None:
    """The Host and Origin checks (see the module's docstring); Forbidden when refused.
    `listening`: as host_allowed's."""
    host = request.headers.get(hdrs.HOST)
    if not host_allowed(host, server, listening):
        raise _refuse_host(host or "")
    origin = request.headers.get(hdrs.ORIGIN)
    if origin is not None and not origin_allowed(origin, request, server):
        raise Forbidden(f"Origin {origin!r} may not use hal0d: only its own origin and "
                        "[server] allowed_origins may")


def preflight(request: web.Request, server: ServerConfig) -> web.Response | None:
    """The answer to a CORS preflight from an allowed foreign origin, or None when the request
    is no such preflight."""
    origin = cross_origin(request, server)
    if (origin is None or request.method != hdrs.METH_OPTIONS
            or hdrs.ACCESS_CONTROL_REQUEST_METHOD not in request.headers):
        return None
    headers = {
        hdrs.ACCESS_CONTROL_ALLOW_ORIGIN: origin,
        hdrs.ACCESS_CONTROL_ALLOW_METHODS: CORS_METHODS,
        hdrs.ACCESS_CONTROL_MAX_AGE: CORS_MAX_AGE_S,
        hdrs.VARY: "Origin",
    }
    if requested := request.headers.get(hdrs.ACCESS_CONTROL_REQUEST_HEADERS):
        headers[hdrs.ACCESS_CONTROL_ALLOW_HEADERS] = requested
    return web.Response(status=204, headers=headers)


def add_cors_headers(request: web.Request, response: web.StreamResponse,
                     server: ServerConfig) -> None:
    """An allowed foreign origin's answer names that origin alone."""
    origin = cross_origin(request, server)
    if origin is not None and response.status != 204:
        response.headers[hdrs.ACCESS_CONTROL_ALLOW_ORIGIN] = origin
        response.headers[hdrs.ACCESS_CONTROL_EXPOSE_HEADERS] = CORS_EXPOSED
        response.headers.add(hdrs.VARY, "Origin")


# What each scope lets a key do, for the refusal's message.
SCOPE_WORK: Final = {INFERENCE: "call models", READ: "read hal0d's state",
                     ADMIN: "load or unload slots, or read the keys' use"}


KEY_REQUIRED: Final = "Authorization: Bearer KEY or x-api-key: KEY"


def check(request: web.Request, ring: KeyRing, scope: str | None) -> Key | None:
    """The key the request came in with when it needs one (`scope`: what its surface says it
    needs, surfaces.py): 401 without a key or with an unknown one, 403 when the key lacks the
    scope. Without a key: the listener's anonymous access, when it lets this request in
    (anonymous). None when keys are not set or the request needs none."""
    if not ring or scope is None:
        return None
    presented = presented_key(request)
    if presented is None:
        return anonymous(request, ring, scope)
    key = ring.identify(presented)
    if key is None:
        raise Unauthorized("the API key is not valid")
    if scope not in key.scopes:
        raise Forbidden(f"key {key.name!r} may not {SCOPE_WORK[scope]} (its scopes: "
                        f"{', '.join(sorted(key.scopes))}; {request.method} {request.path} "
                        f"needs {scope!r})")
    return key


def anonymous(request: web.Request, ring: KeyRing, scope: str) -> Key:
    """The Key a request without one is judged by: its listener's anonymous access, when the
    request comes from one of its networks and needs one of its scopes; else 401, as for any
    request without a key (a key may still be let in where anonymous is not)."""
    access = ring.anonymous_on(listener_port(request))
    if access is None or not access.admits(request.remote):
        raise Unauthorized(f"an API key is required: {KEY_REQUIRED}")
    if scope not in access.key.scopes:
        may = ", ".join(SCOPE_WORK[own] for own in sorted(access.key.scopes))
        raise Unauthorized(f"an API key is required to {SCOPE_WORK[scope]} (without one, "
                           f"requests here may {may}): {KEY_REQUIRED}")
    return access.key


def listener_port(request: web.Request) -> int | None:
    """The port of the listener the request came in on (each listener has its own access)."""
    sockname = request.transport.get_extra_info("sockname") if request.transport else None
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def may_see_details(request: web.Request, ring: KeyRing) -> bool:
    """Open probes (/readyz) answer anyone, but the slots' reasons (error texts, upstream
    addresses) are what /api/slots guards: with keys set, only a key holder sees them."""
    if not ring:
        return True
    presented = presented_key(request)
    return presented is not None and ring.identify(presented) is not None
