"""A listener's `anonymous` table: what a request that carries no key may do there, beside keys.

Some apps cannot send a key (Home Assistant's Ollama integration sends none), and the only other
way to let them in, no keys at all, leaves loading and unloading open to everyone. So each
listener (`[server]`, `[ollama]`) may say what a keyless request gets: `scopes` and `models` read
as a key's, and `networks`, the source addresses (CIDR ranges) whose keyless requests count as
anonymous. A request that carries a key is judged by its key alone.

What is refused, and why:
  admin in the scopes    loading and unloading for whoever asks is what keys are set to stop
  no networks, on a listener beyond loopback
                         every machine that reaches it would count; say which ones do (without
                         `networks`, only loopback does, whatever address hal0d listens on)
  no key at all          without keys every request is let in already: the table would do
                         nothing
  a [[keys]] table named `anonymous`
                         that is the name keyless requests are recorded under (the history,
                         request.done, /metrics): two clients would share it
"""

from __future__ import annotations

import ipaddress
from typing import Any, Final

from hal0d.config.client_keys import check_scopes, check_share
from hal0d.config.model import ANONYMOUS_SCOPES, AnonymousConfig, KeyConfig, is_loopback
from hal0d.config.spec import ANONYMOUS_SPEC, check_table, string_list

# The name keyless requests are recorded and limited under.
ANONYMOUS: Final = "anonymous"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
# Who counts as anonymous on a listener whose table names no networks: this machine alone.
LOOPBACK_NETWORKS: Final[tuple[Network, ...]] = (ipaddress.ip_network("127.0.0.0/8"),
                                                 ipaddress.ip_network("::1/128"))


def check_anonymous(raw: Any, where: str, host: str | None, problems: list[str]
                    ) -> AnonymousConfig | None:
    """The table at `where` ("server.anonymous"), on a listener at `host` (None when its
    address is unknown: its own problem is reported); None when it is not usable."""
    before = len(problems)
    good = check_table(raw, ANONYMOUS_SPEC, where, problems)
    if isinstance(raw, dict) and "scopes" not in raw:
        problems.append(f"{where}.scopes: is required (any of {', '.join(ANONYMOUS_SCOPES)})")
    elif "scopes" in good:
        good["scopes"] = check_scopes(
            good["scopes"], f"{where}.scopes", problems, ANONYMOUS_SCOPES,
            refused="is never for requests without a key (anyone could load and unload)")
    if "models" in good:
        good["models"] = string_list(good["models"], f"{where}.models", problems)
    check_share(good, where, problems)
    if "networks" in good:
        good["networks"] = _networks(good["networks"], f"{where}.networks", problems)
    elif isinstance(raw, dict) and host is not None and not is_loopback(host.strip("[]")):
        problems.append(f"{where}.networks: is required on a listener beyond loopback ({host}): "
                        "the source addresses whose requests without a key count, in CIDR "
                        'form ("192.168.1.0/24")')
    return AnonymousConfig(**good) if len(problems) == before else None


def _networks(listed: list[Any], where: str, problems: list[str]) -> tuple[str, ...]:
    """Each range as ipaddress writes it; a written address with host bits set
    ("192.168.1.7/24") names its network, as `ip route` reads it."""
    ranges: list[str] = []
    if not listed:
        problems.append(f"{where}: must list at least one address range")
    for entry in listed:
        try:
            ranges.append(str(ipaddress.ip_network(str(entry).strip(), strict=False)))
        except ValueError:
            problems.append(f"{where}: {entry!r} is not an address range in CIDR form "
                            '("192.168.1.0/24", "10.0.0.5/32", "fd00::/8")')
    return tuple(ranges)


def networks_of(anonymous: AnonymousConfig) -> tuple[Network, ...]:
    """The source ranges whose requests without a key count as anonymous."""
    if anonymous.networks is None:
        return LOOPBACK_NETWORKS
    return tuple(ipaddress.ip_network(entry) for entry in anonymous.networks)


def check_beside_keys(tables: dict[str, AnonymousConfig | None], has_keys: bool,
                      keys: tuple[KeyConfig, ...], problems: list[str]) -> None:
    """The refusals that need the keys: an anonymous table without any key, a key that takes
    the anonymous name. `tables`: each listener's table by its key path."""
    given = [where for where, table in tables.items() if table is not None]
    if not given:
        return
    if not has_keys:
        for where in given:
            problems.append(f"{where}: does nothing without a key ([[keys]], [server] api_keys): "
                            "with no keys set every request is let in")
    for index, key in enumerate(keys):
        if key.name == ANONYMOUS:
            problems.append(f"keys[{index}].name: {ANONYMOUS!r} is the name requests without a "
                            f"key are recorded under ({', '.join(given)}); choose another")
