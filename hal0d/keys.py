"""Client keys: who a presented key says the client is, what it may reach, and how much it is
doing at once.

A key comes from a `[[keys]]` table (a name, scopes, optional model globs and limits) or from the
older `[server] api_keys` / `api_keys_file` (no name, every scope, no limits). A request's path
decides the scope it needs:

    inference   /v1/*, /llm/*                         (a model call, the model list)
    read        GET /api/*, /api/events, /metrics     (/metrics only with protect_metrics)
    admin       POST /api/slots/{name}/load|unload    (and any other non-GET under /api/),
                GET /api/keys                         (every key's use)

On the Ollama listener ([ollama] listen) every route is a model's (`inference`) but `/` and
/api/version, which Ollama clients ask to see that a server is there.

A request without a key gets its listener's `anonymous` access, when it has one and the request
comes from one of its networks (config/anonymous.py): it is judged as a key named `anonymous`
with the table's scopes and models, and recorded under that name. A request that carries a key
is judged by that key alone, a wrong one included (401, never the anonymous access).

The page itself (/ and /static/*) and the probes (/healthz, /readyz) need none: they hold no data,
and the page asks for a key before it reads /api/.

A key's limits count its model calls alone: `max_concurrent` those in hal0d at once (queued or
being answered, across slots), `requests_per_minute` those begun in the last 60 s (a sliding
window, bounded by the limit itself), `tokens_per_hour` and `tokens_per_day` the tokens its
answers used (shares/quotas.py). The page's polls are never throttled. A key's share of the box
(its class and weight, hal0d/shares) is what its requests carry into the slots' queues.

Keys are compared in constant time: the presented key is compared with every accepted one by
hmac.compare_digest, without an early exit.
"""

from __future__ import annotations

import fnmatch
import hmac
import ipaddress
import math
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Final

from aiohttp import hdrs, web

from hal0d.config import (
    ANONYMOUS,
    KEY_SCOPES,
    AnonymousConfig,
    Config,
    KeyConfig,
    Network,
    networks_of,
)
from hal0d.errors import Forbidden, KeyLimited
from hal0d.shares import BATCH, DEFAULT_SHARE, Share
from hal0d.shares.quotas import DAY, HOUR, LocalCounts, Quota, TokenCounts, check

INFERENCE, READ, ADMIN = KEY_SCOPES
EVERY_SCOPE: Final = frozenset(KEY_SCOPES)
RATE_WINDOW_S: Final = 60.0
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Key:
    # None for an api_keys / api_keys_file key: it has no name to show.
    name: str | None
    scopes: frozenset[str] = EVERY_SCOPE
    models: tuple[str, ...] | None = None  # globs; None is every model
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    # A listener's access for requests without a key (named ANONYMOUS), not a presented key.
    anonymous: bool = False
    share: Share = DEFAULT_SHARE
    quotas: tuple[Quota, ...] = ()

    @property
    def limited(self) -> bool:
        return (self.max_concurrent is not None or self.requests_per_minute is not None
                or bool(self.quotas))

    def may_use(self, model: str) -> bool:
        """Whether a glob of the key matches `model`, a served model: the one a request's name
        resolves to (its alias applied), a route's own model for a route. Never the name the
        client typed: with a glob alias (`"*" = "reasoning"`) every name would match a glob."""
        if self.models is None:
            return True
        return any(fnmatch.fnmatchcase(model, glob) for glob in self.models)

    def check_model(self, requested: str, served: str) -> None:
        """Forbidden (403, naming the key) unless the key may use `served`, the model
        `requested` resolves to."""
        if not self.may_use(served):
            named = repr(requested) if requested == served else f"{requested!r} ({served!r})"
            who = "a request without a key" if self.anonymous else f"key {self.name!r}"
            raise Forbidden(f"{who} may not use model {named} (it may use "
                            f"{', '.join(self.models or ())})", field="model")


KEY: Final = web.RequestKey("hal0d_key", Key)


def scope_of(method: str, path: str, protect_metrics: bool) -> str | None:
    """The scope a request needs (see the module's docstring), None when it needs no key."""
    if path.startswith(("/v1/", "/llm/")):
        return INFERENCE
    if path.startswith("/api/"):
        # Which keys there are and what each uses is the operator's to see.
        if path == "/api/keys":
            return ADMIN
        return READ if method in (hdrs.METH_GET, hdrs.METH_HEAD) else ADMIN
    if path == "/metrics" and protect_metrics:
        return READ
    return None


# The Ollama listener's routes that need no key: "is a server there, and which".
OLLAMA_OPEN_PATHS: Final = frozenset({"/", "/api/version"})


def ollama_scope_of(method: str, path: str) -> str | None:
    """The scope a request on the Ollama listener needs (see the module's docstring)."""
    return None if path in OLLAMA_OPEN_PATHS else INFERENCE


def source_address(remote: str | None) -> IPAddress | None:
    """A request's source address as the networks are matched against it: an IPv4 client of a
    dual-stack listener (`::ffff:192.168.1.5`) as IPv4, a link-local one without its zone."""
    if not remote:
        return None
    try:
        address = ipaddress.ip_address(remote.partition("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def share_of(name: str, table: KeyConfig | AnonymousConfig) -> Share:
    """The share a key's (or a listener's anonymous) table gives its requests."""
    if table.service_class != BATCH and table.weight == 1.0:
        return Share(name)
    return Share(name, table.service_class == BATCH, table.weight)


def quotas_of(table: KeyConfig | AnonymousConfig) -> tuple[Quota, ...]:
    return tuple(Quota(per, tokens) for per, tokens in (
        (HOUR, table.tokens_per_hour), (DAY, table.tokens_per_day)) if tokens is not None)


@dataclass(frozen=True, slots=True)
class Anonymous:
    """A listener's access for requests without a key: the Key they are judged by, and the
    source ranges whose requests count."""

    key: Key
    networks: tuple[Network, ...]

    @classmethod
    def of(cls, table: AnonymousConfig | None) -> Anonymous | None:
        if table is None:
            return None
        key = Key(ANONYMOUS, frozenset(table.scopes), table.models, anonymous=True,
                  share=share_of(ANONYMOUS, table), quotas=quotas_of(table))
        return cls(key, networks_of(table))

    def admits(self, remote: str | None) -> bool:
        address = source_address(remote)
        return address is not None and any(address in network for network in self.networks)


class KeyRing:
    """Every key a configuration accepts, by its secret, and each listener's access without one
    (built with the Runtime, so a reload brings the new keys without touching a slot)."""

    def __init__(self, config: Config) -> None:
        self._secrets: list[tuple[bytes, Key]] = [
            (secret.encode(), Key(None)) for secret in sorted(config.server.accepted_keys)
        ]
        for entry in config.keys:
            key = Key(entry.name, frozenset(entry.scopes), entry.models, entry.max_concurrent,
                      entry.requests_per_minute, share=share_of(entry.name, entry),
                      quotas=quotas_of(entry))
            self._secrets.append((entry.secret.encode(), key))
        self.names: tuple[str, ...] = tuple(entry.name for entry in config.keys)
        self._server_anonymous = Anonymous.of(config.server.anonymous)
        self._ollama_anonymous = Anonymous.of(config.ollama.anonymous)
        address = config.ollama.address
        self._ollama_port = address[1] if address is not None else None

    def __bool__(self) -> bool:
        return bool(self._secrets)

    def named(self) -> list[Key]:
        """Every key with a name, in config order, then the anonymous access (one account for
        both listeners: [server]'s table shown when both have one)."""
        found = [key for _, key in self._secrets if key.name is not None]
        anonymous = self._server_anonymous or self._ollama_anonymous
        return found + ([anonymous.key] if anonymous is not None else [])

    def anonymous_on(self, port: int | None) -> Anonymous | None:
        """The access without a key of the listener on `port` (the Ollama listener's port is
        its own; any other is [server]'s)."""
        if self._ollama_port is not None and port == self._ollama_port:
            return self._ollama_anonymous
        return self._server_anonymous

    def identify(self, presented: str) -> Key | None:
        # aiohttp decodes header bytes with surrogateescape; encode them back the same way.
        given = presented.encode("utf-8", "surrogateescape")
        found: Key | None = None
        for secret, key in self._secrets:
            if hmac.compare_digest(given, secret):
                found = key
        return found


class KeyLimits:
    """What each named key is doing now: its model calls in flight and the start times of those
    of the last minute. One for the process: a reload keeps the counts (a request begun before
    it still counts), and a key's new limits apply from its next request."""

    def __init__(self, counts: TokenCounts | None = None) -> None:
        self._in_flight: dict[str, int] = {}
        self._begun: dict[str, deque[float]] = {}
        # Each key's tokens this hour and today (shares/quotas.py): its quotas are read here.
        self.counts: TokenCounts = counts if counts is not None else LocalCounts()

    def in_flight(self, name: str) -> int:
        return self._in_flight.get(name, 0)

    @contextmanager
    def admitted(self, key: Key | None) -> Iterator[None]:
        """Counts one model call of `key` while the block runs; KeyLimited (429, with
        Retry-After) when the key is at one of its limits. None, or a key without a name (an
        api_keys key), passes and is not counted."""
        name = key.name if key is not None else None
        if key is None or name is None:
            yield
            return
        if key.limited:
            self._admit(key, name)
        self._in_flight[name] = self._in_flight.get(name, 0) + 1
        try:
            yield
        finally:
            left = self._in_flight[name] - 1
            if left:
                self._in_flight[name] = left
            else:
                del self._in_flight[name]

    def _admit(self, key: Key, name: str) -> None:
        if key.quotas:
            check(name, key.quotas, self.counts)
        if key.max_concurrent is not None and self.in_flight(name) >= key.max_concurrent:
            raise KeyLimited(f"key {name!r} has {key.max_concurrent} requests in flight, its "
                             "max_concurrent; retry when one ends", retry_after=1.0)
        if key.requests_per_minute is None:
            return
        now = time.monotonic()
        begun = self._begun.setdefault(name, deque())
        while begun and begun[0] <= now - RATE_WINDOW_S:
            begun.popleft()
        if len(begun) >= key.requests_per_minute:
            wait_s = begun[0] + RATE_WINDOW_S - now
            raise KeyLimited(f"key {name!r} made {key.requests_per_minute} requests in the last "
                             f"minute, its requests_per_minute; retry in {math.ceil(wait_s)} s",
                             retry_after=wait_s)
        begun.append(now)
