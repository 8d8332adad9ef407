"""The checks a spec table cannot make, section by section: slots, groups, routes, model
aliases, the Ollama listener, the devices and the names the server lets in.

Each takes its decoded TOML, reads it by its spec table (spec.py), appends a problem with its
key path for all that is still wrong (a required key, a name used twice, a group no [groups]
table defines) and returns what is good. A problem inside one slot or route ends with its name
(`(slot "big")`), so a long list stays readable. The checks after the slots' are handed
only the slots that passed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hal0d.config.anonymous import check_anonymous
from hal0d.config.cache_dir import PROMPT_CACHE_DIR, with_prompt_cache_dir
from hal0d.config.capabilities import check_capabilities
from hal0d.config.model import (
    LIFECYCLE_KEYS,
    ON_DEMAND_KEYS,
    PROMPT_CACHE_MODES,
    PROMPT_CACHE_SAVE,
    REDACTED_SECRET,
    START_ALWAYS,
    START_ON_DEMAND,
    GroupConfig,
    RouteConfig,
    ServerConfig,
    SlotConfig,
    split_address,
)
from hal0d.config.ports import with_free_port
from hal0d.config.spec import (
    ANTHROPIC_MODES,
    DEVICES_SPEC,
    GROUP_POLICIES,
    GROUP_SPEC,
    OLLAMA_SPEC,
    RESPONSES_MODES,
    ROUTE_SPEC,
    SLOT_KINDS,
    SLOT_SPEC,
    check_table,
    one_of,
    string_list,
)

# A slot's name is a folder's name too (its saved prompt caches): no separator, no `..`, no
# hidden name, nothing a shell or a URL would have to quote.
SLOT_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")


def check_slots(raw: Any, problems: list[str], base_dir: Path,
                cache_root: Path | None = None,
                found: Sequence[tuple[str, dict[str, Any]]] = ()) -> tuple[SlotConfig, ...]:
    """The [[slots]], then the slots of the models the [[library]] tables found (`found`:
    each with where it came from); `cache_root`: where `{prompt_cache_dir}` folders go
    (config/cache_dir.py), beside the history database (base_dir when not given)."""
    if not isinstance(raw, list):
        problems.append("slots: must be an array of tables ([[slots]])")
        return ()
    slots: list[SlotConfig] = []
    names: set[str] = set()
    served: dict[str, str] = {}
    labelled = [(f"slots[{index}]", table) for index, table in enumerate(raw)] + list(found)
    for path, table in labelled:
        before = len(problems)
        good = check_table(table, SLOT_SPEC, path, problems)
        for required in ("name", "upstream", "models"):
            if isinstance(table, dict) and required not in table:
                problems.append(f"{path}.{required}: is required")
        _check_lists(good, path, problems)
        if "capabilities" in good:
            good["capabilities"] = check_capabilities(
                good["capabilities"], good.get("models") or (), f"{path}.capabilities", problems)
        upstream = good.get("upstream")
        if isinstance(upstream, str) and not upstream.startswith(("http://", "https://")):
            problems.append(f"{path}.upstream: {upstream!r} must start with http:// or https://")
        if (name := _named(good, "name", path, problems)) is not None:
            if not SLOT_NAME.fullmatch(name):
                problems.append(f"{path}.name: {name!r} must be letters, digits, '.', '_' and "
                                "'-', not starting with '.' (it names the slot's folder of "
                                "saved prompt caches)")
            if name in names:
                problems.append(f"{path}.name: {name!r} is used by another slot")
            names.add(name)
        _check_lifecycle(good, table, path, problems)
        for key, choices in (("anthropic", ANTHROPIC_MODES), ("responses", RESPONSES_MODES),
                             ("kind", SLOT_KINDS), ("prompt_cache", PROMPT_CACHE_MODES)):
            one_of(good, key, choices, path, problems)
        if "api_key" in good and "api_key_env" in good:
            problems.append(f"{path}: set api_key or api_key_env, not both")
        if good.get("api_key") == REDACTED_SECRET:
            problems.append(f"{path}.api_key: {REDACTED_SECRET!r} is what print-config writes "
                            "in place of a secret: put the key back (or use api_key_env)")
        for model in good.get("models") or ():
            if model in served:
                problems.append(
                    f"{path}.models: {model!r} is already served by slot {served[model]!r}"
                )
            served[model] = str(name)
        if len(problems) == before:
            good["upstream"] = good["upstream"].rstrip("/")
            good = with_prompt_cache_dir(good, cache_root or base_dir)
            slots.append(SlotConfig(**with_free_port(good, base_dir)))
        elif isinstance(name, str) and name:
            problems[before:] = [f'{problem} (slot "{name}")' for problem in problems[before:]]
    return tuple(slots)


def _check_lists(good: dict[str, Any], path: str, problems: list[str]) -> None:
    """A slot's list keys, each made a tuple (None, with a problem, when it is no such list)."""
    for key, check in (("models", string_list), ("command", string_list),
                       ("devices", device_list)):
        if key in good:
            good[key] = check(good[key], f"{path}.{key}", problems)


def device_list(value: list[Any], where: str, problems: list[str]) -> tuple[int, ...] | None:
    """A slot's `devices`: device indexes, at least one, none twice."""
    if not value or not all(type(item) is int and 0 <= item < 1024 for item in value) or len(
            set(value)) != len(value):
        problems.append(f"{where}: must be a non-empty list of device indexes (0-1023), each "
                        "once, as /api/devices numbers them")
        return None
    return tuple(value)


def _named(good: dict[str, Any], key: str, path: str, problems: list[str]) -> str | None:
    """The table's name for itself (`key`), when it is a non-empty string; an empty one is a
    problem, another type already is one (check_table)."""
    value = good.get(key)
    if not isinstance(value, str):
        return None
    if not value:
        problems.append(f"{path}.{key}: must not be empty")
        return None
    return value


def _check_lifecycle(good: dict[str, Any], table: Any, path: str, problems: list[str]) -> None:
    start = good.get("start", START_ALWAYS)
    if start not in (START_ALWAYS, START_ON_DEMAND):
        problems.append(f"{path}.start: {start!r} is not one of ('always', 'on_demand')")
    if good.get("command") or (isinstance(table, dict) and "command" in table):
        # A command given, if malformed, has its own problem: no follow-ons from it.
        if start == START_ALWAYS:
            for key in ON_DEMAND_KEYS:
                if isinstance(table, dict) and key in table:
                    problems.append(f"{path}.{key}: only for start = 'on_demand' (an 'always' "
                                    "slot is kept up, never unloaded when idle)")
        if good.get("prompt_cache") == PROMPT_CACHE_SAVE and not any(
                PROMPT_CACHE_DIR in arg for arg in good.get("command") or ()):
            problems.append(f"{path}.prompt_cache: 'save' needs {PROMPT_CACHE_DIR} in the "
                            "command, where the server writes its caches (llama-server: "
                            f"--slot-save-path {PROMPT_CACHE_DIR})")
        if start == START_ON_DEMAND and good.get("max_queue") == 0:
            problems.append(f"{path}.max_queue: 0 leaves no place for the request that loads an "
                            "on-demand slot (it waits in the queue for the load): at least 1")
        return
    # Without a command hal0d has nothing to start or stop: these would silently do nothing.
    if start == START_ON_DEMAND:
        problems.append(f"{path}.start: 'on_demand' needs a command for hal0d to start")
    for key in LIFECYCLE_KEYS:
        if isinstance(table, dict) and key in table:
            problems.append(f"{path}.{key}: only for a slot with a command (hal0d starts it)")


def check_groups(
    raw: Any, slots: tuple[SlotConfig, ...], problems: list[str], raw_slots: Any = ()
) -> dict[str, GroupConfig]:
    if not isinstance(raw, dict):
        problems.append("groups: must be a table of [groups.NAME] tables")
        return {}
    groups: dict[str, GroupConfig] = {}
    for name, table in raw.items():
        where = f"groups.{name}"
        good = check_table(table, GROUP_SPEC, where, problems)
        if "free_memory_command" in good:
            good["free_memory_command"] = string_list(
                good["free_memory_command"], f"{where}.free_memory_command", problems
            )
        if not one_of(good, "policy", GROUP_POLICIES, where, problems):
            good.pop("policy")
        groups[name] = GroupConfig(name=name, **good)
    members: dict[str, list[tuple[int, SlotConfig]]] = {name: [] for name in groups}
    for index, slot in enumerate(slots):
        if slot.group is None:
            continue
        if slot.group not in groups:
            problems.append(f"slots[{index}].group: {slot.group!r} is not a [groups] table "
                            f"(defined: {', '.join(sorted(groups)) or 'none'}) "
                            f'(slot "{slot.name}")')
            continue
        members[slot.group].append((index, slot))
    # A group that a slot with problems of its own names is not "named by no slot".
    claimed = {table.get("group") for table in raw_slots if isinstance(table, dict)}
    for name, group in groups.items():
        if members[name] or name not in claimed:
            _check_group_members(group, members[name], problems)
    return groups


def _check_group_members(
    group: GroupConfig, members: list[tuple[int, SlotConfig]], problems: list[str]
) -> None:
    where = f"groups.{group.name}"
    if not members:
        problems.append(f"{where}: no slot names this group")
        return
    needs_memory = group.memory_mib is not None or group.free_memory_command is not None
    for index, slot in members:
        if needs_memory and slot.memory_mib is None:
            problems.append(f"slots[{index}].memory_mib: is required in group {group.name!r}, "
                            "which counts memory")
        if group.memory_mib is not None and (slot.memory_mib or 0) > group.memory_mib:
            problems.append(f"slots[{index}].memory_mib: {slot.memory_mib} MiB exceeds the "
                            f"budget of group {group.name!r} ({group.memory_mib} MiB)")
    # `always` slots are loaded for good (never evicted): they alone must fit.
    pinned = [slot for _, slot in members if not slot.on_demand]
    if group.max_loaded is not None and len(pinned) > group.max_loaded:
        problems.append(f"{where}.max_loaded: {group.max_loaded} is fewer than its "
                        f"{len(pinned)} slots with start = 'always'")
    pinned_mib = sum(slot.memory_mib or 0 for slot in pinned)
    if group.memory_mib is not None and pinned_mib > group.memory_mib:
        problems.append(f"{where}.memory_mib: {group.memory_mib} MiB is less than the "
                        f"{pinned_mib} MiB of its slots with start = 'always'")


@dataclass(frozen=True, slots=True)
class Broken:
    """The slots and models of tables that failed their own checks. A route or an alias that
    names one adds no problem of its own: the table's own problems say what to fix, and "is no
    slot" beside them would only send the reader looking for a slot that is there, misspelt."""

    slots: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()

    def __or__(self, other: Broken) -> Broken:
        return Broken(self.slots | other.slots, self.models | other.models)


def broken_slots(raw: Any, passed: tuple[SlotConfig, ...]) -> Broken:
    """The names and models of the [[slots]] tables that are not among `passed`."""
    names = {slot.name for slot in passed}
    tables = [table for table in raw if isinstance(table, dict)] if isinstance(raw, list) else []
    failed = [table for table in tables if table.get("name") not in names]
    return Broken(
        frozenset(str(table["name"]) for table in failed if "name" in table),
        frozenset(str(model) for table in failed if isinstance(table.get("models"), list)
                  for model in table["models"]))


def broken_routes(raw: Any, passed: tuple[RouteConfig, ...]) -> Broken:
    """The models of the [[routes]] tables that are not among `passed`."""
    models = {route.model for route in passed}
    tables = [table for table in raw if isinstance(table, dict)] if isinstance(raw, list) else []
    return Broken(models=frozenset(str(table["model"]) for table in tables
                                   if "model" in table and table["model"] not in models))


def check_routes(raw: Any, slots: tuple[SlotConfig, ...], problems: list[str],
                 broken: Broken = Broken()) -> tuple[RouteConfig, ...]:
    """The [[routes]] tables: a model no slot serves by itself, slots that exist (at least one),
    `served` naming only those slots. A route naming a slot in `broken` is left out quietly."""
    if not isinstance(raw, list):
        problems.append("routes: must be an array of tables ([[routes]])")
        return ()
    names = {slot.name for slot in slots}
    own = {model: slot.name for slot in slots for model in slot.models}
    routes: list[RouteConfig] = []
    seen: set[str] = set()
    for index, table in enumerate(raw):
        path = f"routes[{index}]"
        before = len(problems)
        names_broken: list[str] = []
        good = check_table(table, ROUTE_SPEC, path, problems)
        for required in ("model", "slots"):
            if isinstance(table, dict) and required not in table:
                problems.append(f"{path}.{required}: is required")
        if (model := _named(good, "model", path, problems)) is not None:
            if model in own:
                problems.append(f"{path}.model: {model!r} is already slot {own[model]!r}'s own "
                                "model; a route names a model no slot lists")
            elif model in seen:
                problems.append(f"{path}.model: {model!r} has another route")
            seen.add(model)
        if "slots" in good:
            listed = string_list(good["slots"], f"{path}.slots", problems)
            if listed is not None:
                unknown = [name for name in listed if name not in names]
                names_broken = [name for name in unknown if name in broken.slots]
                unknown = [name for name in unknown if name not in broken.slots]
                if unknown:
                    problems.append(f"{path}.slots: {', '.join(map(repr, unknown))} is no slot "
                                    f"(slots: {', '.join(sorted(names)) or 'none'})")
                if len(set(listed)) != len(listed):
                    problems.append(f"{path}.slots: names a slot twice")
                good["slots"] = listed
        served = good.get("served", {})
        for slot, name in served.items():
            if slot not in (good.get("slots") or ()):
                problems.append(f"{path}.served.{slot}: is not one of the route's slots")
            elif not isinstance(name, str) or not name:
                problems.append(f"{path}.served.{slot}: must be a non-empty model name")
        if len(problems) == before and not names_broken:
            routes.append(RouteConfig(**good))
        elif isinstance(model, str) and model:
            problems[before:] = [f'{problem} (route "{model}")' for problem in problems[before:]]
    return tuple(routes)


def check_models(raw: Any, slots: tuple[SlotConfig, ...], problems: list[str],
                 routes: tuple[RouteConfig, ...] = (), broken: Broken = Broken()
                 ) -> dict[str, str]:
    """The aliases: each names a served model; one naming a model of a table in `broken` adds
    no problem (that table's own say what is wrong)."""
    if not isinstance(raw, dict):
        problems.append("models: must be a table of alias = served model")
        return {}
    served = {model for slot in slots for model in slot.models} | {r.model for r in routes}
    aliases: dict[str, str] = {}
    for pattern, target in raw.items():
        where = f"models.{pattern!r}" if not pattern.isidentifier() else f"models.{pattern}"
        if not isinstance(target, str):
            problems.append(f"{where}: {target!r} is not a string")
        elif target in broken.models and target not in served:
            continue
        elif slots and target not in served:
            problems.append(f"{where}: {target!r} is not a model any slot "
                            + ("or route serves" if routes else "serves"))
        else:
            aliases[pattern] = target
    return aliases


def check_ollama(raw: Any, server: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """[ollama] listen: host:port, on a port of its own (not [server].port); its anonymous
    table (config/anonymous.py) only beside a listen."""
    good = check_table(raw, OLLAMA_SPEC, "ollama", problems)
    listen = good.get("listen")
    address = None if listen is None else split_address(listen)
    if "anonymous" in good:
        if listen is None:
            problems.append("ollama.anonymous: only with ollama.listen (there is no Ollama "
                            "listener without it)")
        good["anonymous"] = check_anonymous(good["anonymous"], "ollama.anonymous",
                                            address[0] if address else None, problems)
    if listen is None:
        return good
    if address is None:
        problems.append(f"ollama.listen: {listen!r} is not host:port (e.g. \"127.0.0.1:11434\", "
                        "\"[::1]:11434\")")
        del good["listen"]
    elif address[1] == server.get("port", ServerConfig().port):
        problems.append(f"ollama.listen: port {address[1]} is [server].port's; the Ollama API "
                        "needs a port of its own")
        del good["listen"]
    return good


def check_devices(raw: Any, problems: list[str]) -> dict[str, Any]:
    """[devices]: its devices_command a non-empty list of strings (an argv, run without a
    shell); margins_mib a table of device index to MiB (`{ 1 = 2048 }`)."""
    good = check_table(raw, DEVICES_SPEC, "devices", problems)
    if "devices_command" in good:
        command = string_list(good["devices_command"], "devices.devices_command", problems)
        if command is None:
            del good["devices_command"]
        else:
            good["devices_command"] = command
    if "margins_mib" in good:
        margins = {int(key): value for key, value in good["margins_mib"].items()
                   if key.isdigit() and int(key) < 1024 and isinstance(value, int)
                   and not isinstance(value, bool) and 0 <= value <= 1 << 20}
        if len(margins) != len(good["margins_mib"]):
            problems.append("devices.margins_mib: must map device indexes, as /api/devices "
                            "numbers them, to MiB (0-1048576), e.g. { 1 = 2048 }")
        good["margins_mib"] = margins
    return good


def _host_name(entry: Any) -> str | None:
    """An allowed_hosts entry as a request's Host is compared with it: lower-cased, an IPv6
    address without its brackets; None when it is no bare host name (a port, a scheme)."""
    if not isinstance(entry, str) or not entry.strip() or "/" in entry:
        return None
    name = entry.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        return name[1:-1]
    return None if ":" in name else name


def allowed_names(server: dict[str, Any], problems: list[str]) -> None:
    """allowed_hosts: host names (no port, no scheme); allowed_origins: browser origins,
    `scheme://host[:port]`, lower-cased, without a trailing slash."""
    hosts = [_host_name(entry) for entry in server.get("allowed_hosts", [])]
    if None in hosts:
        problems.append("server.allowed_hosts: every entry must be a host name without port "
                        "or scheme, e.g. \"box.lan\"")
    else:
        server["allowed_hosts"] = tuple(h for h in hosts if h)
    origins = server.get("allowed_origins", [])
    if not all(isinstance(o, str) and o.startswith(("http://", "https://")) for o in origins):
        problems.append("server.allowed_origins: every entry must be an origin such as "
                        "\"http://webui.lan:3000\"")
    else:
        server["allowed_origins"] = tuple(o.strip().rstrip("/").lower() for o in origins)
