"""Access control: which requests need a key, and whether the one they carry is accepted.

/healthz and /readyz never need one: a load balancer's or systemd's probe carries no key. /readyz
shows the slots' reasons only to a key holder when keys are set (may_see_details).

Keys are compared in constant time (hmac.compare_digest against every accepted key, without an
early exit), so response timing tells nothing about how much of a key was right.
"""

from __future__ import annotations

import hmac
import ipaddress

from aiohttp import hdrs, web

from hal0d.config import ServerConfig
from hal0d.errors import Unauthorized

PROTECTED_PREFIXES = ("/v1/", "/llm/", "/api/")


def needs_key(path: str, server: ServerConfig) -> bool:
    if not server.accepted_keys:
        return False
    if path == "/metrics":
        return server.protect_metrics
    return path.startswith(PROTECTED_PREFIXES)


def presented_key(request: web.Request) -> str | None:
    """`Authorization: Bearer KEY` (OpenAI clients) or `x-api-key: KEY` (Anthropic clients)."""
    authorization = request.headers.get(hdrs.AUTHORIZATION, "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def is_accepted(key: str, server: ServerConfig) -> bool:
    # aiohttp decodes header bytes with surrogateescape; encode them back the same way.
    given = key.encode("utf-8", "surrogateescape")
    accepted = False
    for candidate in server.accepted_keys:
        accepted |= hmac.compare_digest(given, candidate.encode())
    return accepted


def check(request: web.Request, server: ServerConfig) -> None:
    if not needs_key(request.path, server):
        return
    key = presented_key(request)
    if key is None:
        raise Unauthorized("an API key is required: Authorization: Bearer KEY or x-api-key: KEY")
    if not is_accepted(key, server):
        raise Unauthorized("the API key is not valid")


def may_see_details(request: web.Request, server: ServerConfig) -> bool:
    """Open probes (/readyz) answer anyone, but the slots' reasons (error texts, upstream
    addresses) are what /api/slots guards: with keys set, only a key holder sees them."""
    if not server.accepted_keys:
        return True
    key = presented_key(request)
    return key is not None and is_accepted(key, server)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
