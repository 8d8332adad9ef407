"""Configuration: TOML in, frozen dataclasses out, every problem reported with its key path.

Validation collects all problems before failing, so `hal0d check-config` can print them at once;
nothing starts half-configured. `to_toml` renders the effective configuration (defaults filled).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import socket
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import tomli_w


class ConfigError(Exception):
    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    # listen(2)'s queue of connections not yet accepted; the kernel clips it to somaxconn.
    backlog: int = 2048
    shutdown_grace_s: float = 30.0
    # A connection that has not sent a whole first request head within this is closed.
    header_timeout_s: float = 10.0
    # An idle keep-alive connection is closed after this (aiohttp's own bound).
    keepalive_timeout_s: float = 75.0
    max_body_bytes: int = 32 * 1024 * 1024
    api_keys: tuple[str, ...] = ()
    api_keys_file: str | None = None
    protect_metrics: bool = False
    # Host names (beyond loopback and the listening address) and browser origins let in.
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    # The keys clients may present: api_keys plus the lines of api_keys_file, read at load time.
    # Kept out of repr and of print-config's output.
    accepted_keys: frozenset[str] = field(default=frozenset(), repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class DispatcherConfig:
    """The `[dispatcher]` section: the bounds on a request's way to its upstream. It holds
    timeouts and nothing else, so code that is handed one (often a slot's effective copy,
    SlotConfig.timeouts()) names it `timeouts`."""

    direct_read_timeout_s: float = 300.0
    stream_total_timeout_s: float = 900.0
    stream_idle_timeout_s: float = 300.0
    connect_timeout_s: float = 5.0
    write_timeout_s: float = 10.0
    pool_timeout_s: float = 5.0


START_ALWAYS = "always"
START_ON_DEMAND = "on_demand"
# The keys that only mean something for a slot hal0d starts and stops itself (it has a command).
LIFECYCLE_KEYS = ("idle_unload_s", "group")

# The [dispatcher] timeouts a slot may set for itself.
SLOT_TIMEOUT_KEYS = ("direct_read_timeout_s", "stream_total_timeout_s", "stream_idle_timeout_s")


@dataclass(frozen=True, slots=True)
class SlotConfig:
    name: str
    upstream: str
    models: tuple[str, ...]
    max_concurrent: int = 8
    max_queue: int = 32
    queue_timeout_s: float = 30.0
    api_key: str | None = None
    api_key_env: str | None = None
    command: tuple[str, ...] | None = None
    max_output_tokens: int | None = None
    # This slot's own stall and read bounds; None means the [dispatcher] value. A remote
    # provider and a local 70B model deserve different bounds, and so does the demo's stub.
    direct_read_timeout_s: float | None = None
    stream_total_timeout_s: float | None = None
    stream_idle_timeout_s: float | None = None
    # Model lifecycle: "always" starts the command with hal0d and keeps it up; "on_demand" starts
    # it for the first request and stops it after idle_unload_s with nothing to do (0 = never).
    start: str = "always"
    idle_unload_s: float = 0.0
    load_timeout_s: float = 600.0
    group: str | None = None
    memory_mib: int | None = None
    # The Anthropic Messages surface for this slot's models: "translate" (to chat completions),
    # "native" (relayed raw to the upstream's own /v1/messages), "auto" (native when it has one).
    anthropic: str = "translate"
    # The Responses API for this slot's models: "native" (relayed raw to the upstream's own
    # /v1/responses), "translate" (to chat completions), "auto" (native when it has one).
    responses: str = "native"
    # "openai": an OpenAI-compatible server; "hal0d": another hal0d, whose models' states are
    # followed (lifecycle/remote.py) so a route's prefer_loaded knows what is loaded there.
    kind: str = "openai"

    @property
    def on_demand(self) -> bool:
        return self.start == START_ON_DEMAND

    def timeouts(self, dispatcher: DispatcherConfig) -> DispatcherConfig:
        """The timeouts this slot's requests run on: `dispatcher` with the slot's own bounds
        in place of the ones it sets (the very same object when it sets none)."""
        own = {
            key: value for key in SLOT_TIMEOUT_KEYS if (value := getattr(self, key)) is not None
        }
        return dataclasses.replace(dispatcher, **own) if own else dispatcher

    def bearer_token(self) -> str | None:
        if self.api_key is not None:
            return self.api_key
        if self.api_key_env is not None:
            return os.environ.get(self.api_key_env)
        return None


@dataclass(frozen=True, slots=True)
class GroupConfig:
    """Slots that share a device: at most `max_loaded` of them loaded at once, the sum of their
    `memory_mib` within `memory_mib`, and each load only when `free_memory_command` reports room.
    `policy` says when a model waiting for room may unload a busy one: `batch` once it has
    waited `max_wait_s` (a loaded model serves its queue first), `fifo` at once."""

    name: str
    max_loaded: int | None = None
    memory_mib: int | None = None
    free_memory_command: tuple[str, ...] | None = None
    policy: str = "batch"
    max_wait_s: float = 30.0

    @property
    def batch(self) -> bool:
        return self.policy == POLICY_BATCH


@dataclass(frozen=True, slots=True)
class MetricsConfig:
    database: str = "hal0d-history.sqlite3"
    retention_days: int = 30
    ttft_samples: int = 256


@dataclass(frozen=True, slots=True)
class LoggingConfig:
    level: str = "info"
    format: str = "auto"


@dataclass(frozen=True, slots=True)
class RouteConfig:
    """A `[[routes]]` table: one model name served by several slots, tried in order while
    nothing has reached the client (hal0d.forward)."""

    model: str
    slots: tuple[str, ...]
    # The model name each slot is asked for; a slot not named here is asked for `model`.
    served: dict[str, str] = field(default_factory=dict)
    first_byte_timeout_s: float = 0.0  # 0 = off
    spill_when_busy: bool = False
    prefer_loaded: bool = False

    def served_by(self, slot: str) -> str:
        return self.served.get(slot, self.model)


@dataclass(frozen=True, slots=True)
class OllamaConfig:
    """The `[ollama]` section: a second listener that speaks Ollama's API (off unless set)."""

    listen: str | None = None  # "host:port", e.g. "127.0.0.1:11434"

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) of `listen` (an IPv6 host without its brackets), None when off."""
        return None if self.listen is None else split_address(self.listen)


def split_address(listen: str) -> tuple[str, int] | None:
    """`host:port` (`[::1]:11434` for IPv6) as (host, port); None when it is no such thing."""
    host, colon, port = listen.rpartition(":")
    if not colon or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # an IPv6 address needs its brackets before the port
    return (host, int(port)) if host and " " not in host else None


KEY_SCOPES = ("inference", "read", "admin")
KEY_SECRET_SOURCES = ("key", "key_env", "key_file")


@dataclass(frozen=True, slots=True)
class KeyConfig:
    """A `[[keys]]` table: a client key with a name (shown in the history, the log and /metrics
    instead of the key), what it may reach and how much at once (hal0d.keys)."""

    name: str
    scopes: tuple[str, ...]
    # Where the secret comes from: one of the three (systemd credentials: key_file =
    # "${CREDENTIALS_DIRECTORY}/NAME").
    key: str | None = None
    key_env: str | None = None
    key_file: str | None = None
    models: tuple[str, ...] | None = None  # globs of the model names it may use
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    # The secret itself, read from its source at load time; never printed.
    secret: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    dispatcher: DispatcherConfig = field(default_factory=DispatcherConfig)
    slots: tuple[SlotConfig, ...] = ()
    groups: dict[str, GroupConfig] = field(default_factory=dict)
    models: dict[str, str] = field(default_factory=dict)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    keys: tuple[KeyConfig, ...] = ()
    routes: tuple[RouteConfig, ...] = ()
    ollama: OllamaConfig = field(default_factory=OllamaConfig)
    # The folder relative paths (the metrics database) resolve against.
    base_dir: Path = field(default_factory=Path.cwd, compare=False)

    def database_path(self) -> Path:
        path = Path(self.metrics.database)
        return path if path.is_absolute() else self.base_dir / path


# Per key: (type, minimum, maximum); None means unbounded. Floats accept integers too.
_Range = tuple[type, float | None, float | None]
_SERVER: dict[str, _Range] = {
    "host": (str, None, None),
    "port": (int, 1, 65535),
    "backlog": (int, 1, 65535),
    "shutdown_grace_s": (float, 0.0, 3600.0),
    "header_timeout_s": (float, 1.0, 600.0),
    "keepalive_timeout_s": (float, 1.0, 3600.0),
    "max_body_bytes": (int, 1024, 1 << 32),
    "api_keys": (list, None, None),
    "api_keys_file": (str, None, None),
    "protect_metrics": (bool, None, None),
    "allowed_hosts": (list, None, None),
    "allowed_origins": (list, None, None),
}
_DISPATCHER: dict[str, _Range] = {
    "direct_read_timeout_s": (float, 30.0, 600.0),
    "stream_total_timeout_s": (float, 0.0, 86400.0),
    "stream_idle_timeout_s": (float, 0.0, 86400.0),
    "connect_timeout_s": (float, 0.1, 600.0),
    "write_timeout_s": (float, 0.1, 600.0),
    "pool_timeout_s": (float, 0.1, 600.0),
}
_SLOT: dict[str, _Range] = {
    "name": (str, None, None),
    "upstream": (str, None, None),
    "models": (list, None, None),
    "max_concurrent": (int, 1, 4096),
    "max_queue": (int, 0, 100_000),
    "queue_timeout_s": (float, 0.0, 3600.0),
    "api_key": (str, None, None),
    "api_key_env": (str, None, None),
    "command": (list, None, None),
    "max_output_tokens": (int, 1, 10_000_000),
    **{key: _DISPATCHER[key] for key in SLOT_TIMEOUT_KEYS},  # the same ranges, per slot
    "start": (str, None, None),
    "idle_unload_s": (float, 0.0, 30 * 86400.0),
    "load_timeout_s": (float, 1.0, 86400.0),
    "group": (str, None, None),
    "memory_mib": (int, 1, 1 << 30),
    "anthropic": (str, None, None),
    "responses": (str, None, None),
    "kind": (str, None, None),
}
SLOT_KINDS = ("openai", "hal0d")
ANTHROPIC_MODES = ("translate", "native", "auto")
RESPONSES_MODES = ("native", "translate", "auto")
_GROUP: dict[str, _Range] = {
    "max_loaded": (int, 1, 4096),
    "memory_mib": (int, 1, 1 << 30),
    "free_memory_command": (list, None, None),
    "policy": (str, None, None),
    "max_wait_s": (float, 0.1, 3600.0),
}
_ROUTE: dict[str, _Range] = {
    "model": (str, None, None),
    "slots": (list, None, None),
    "served": (dict, None, None),
    "first_byte_timeout_s": (float, 0.0, 3600.0),
    "spill_when_busy": (bool, None, None),
    "prefer_loaded": (bool, None, None),
}
_KEY: dict[str, _Range] = {
    "name": (str, None, None),
    "key": (str, None, None),
    "key_env": (str, None, None),
    "key_file": (str, None, None),
    "scopes": (list, None, None),
    "models": (list, None, None),
    "max_concurrent": (int, 1, 100_000),
    "requests_per_minute": (int, 1, 1_000_000),
}
POLICY_BATCH = "batch"
POLICY_FIFO = "fifo"
GROUP_POLICIES = (POLICY_BATCH, POLICY_FIFO)
_METRICS: dict[str, _Range] = {
    "database": (str, None, None),
    "retention_days": (int, 1, 36500),
    "ttft_samples": (int, 1, 1_000_000),
}
_LOGGING: dict[str, _Range] = {
    "level": (str, None, None),
    "format": (str, None, None),
}
_OLLAMA: dict[str, _Range] = {
    "listen": (str, None, None),
}
_LOG_LEVELS = ("debug", "info", "warning", "error")
_LOG_FORMATS = ("auto", "console", "json", "journald", "logfmt")


def _type_name(kind: type) -> str:
    return {
        str: "a string", int: "an integer", float: "a number", list: "a list", bool: "a boolean",
        dict: "a table",
    }[kind]


def _check_table(
    raw: Any, spec: dict[str, _Range], path: str, problems: list[str]
) -> dict[str, Any]:
    """Return the valid keys of one table; append a problem for every bad one."""
    if not isinstance(raw, dict):
        problems.append(f"{path}: must be a table")
        return {}
    good: dict[str, Any] = {}
    value: Any
    for key, value in raw.items():
        where = f"{path}.{key}"
        if key not in spec:
            problems.append(f"{where}: unknown key (known: {', '.join(spec)})")
            continue
        kind, low, high = spec[key]
        # bool is an int in Python; a TOML `true` is never a number here.
        if (isinstance(value, bool) and kind is not bool) or not (
            isinstance(value, kind) or (kind is float and isinstance(value, int))
        ):
            problems.append(f"{where}: {value!r} is not {_type_name(kind)}")
            continue
        checked: Any = float(cast(float, value)) if kind is float else value
        if kind is float and not math.isfinite(checked):
            problems.append(f"{where}: {checked!r} is not a finite number")
            continue
        if low is not None and high is not None and not (low <= checked <= high):
            problems.append(f"{where}: {checked!r} is outside {low}-{high}")
            continue
        good[key] = checked
    return good


def _string_list(value: list[Any], where: str, problems: list[str]) -> tuple[str, ...] | None:
    if not value or not all(isinstance(item, str) and item for item in value):
        problems.append(f"{where}: must be a non-empty list of non-empty strings")
        return None
    return tuple(value)


# Written in a slot's `upstream` and `command`: a free loopback port hal0d picks for that slot.
FREE_PORT = "{free_port}"
# The port picked per (config folder, slot name, upstream as written), kept for the process's
# life: a reload of an unchanged slot names the same port (the slot is not restarted).
_picked_ports: dict[tuple[str, str, str], int] = {}


def _unused_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _with_free_port(good: dict[str, Any], base_dir: Path) -> dict[str, Any]:
    """A slot that writes FREE_PORT gets one port of its own in its upstream and its command
    alike: the demo's stub cannot collide with a program on a fixed port (port_taken would
    then only refuse the load, and `make run` would serve nothing)."""
    command = good.get("command") or ()
    if FREE_PORT not in good["upstream"] and not any(FREE_PORT in arg for arg in command):
        return good
    key = (str(base_dir), good["name"], good["upstream"])
    if key not in _picked_ports:
        _picked_ports[key] = _unused_port()
    port = str(_picked_ports[key])
    good["upstream"] = good["upstream"].replace(FREE_PORT, port)
    if command:
        good["command"] = tuple(arg.replace(FREE_PORT, port) for arg in command)
    return good


def _check_slots(raw: Any, problems: list[str], base_dir: Path) -> tuple[SlotConfig, ...]:
    if not isinstance(raw, list):
        problems.append("slots: must be an array of tables ([[slots]])")
        return ()
    slots: list[SlotConfig] = []
    names: set[str] = set()
    served: dict[str, str] = {}
    for index, table in enumerate(raw):
        path = f"slots[{index}]"
        before = len(problems)
        good = _check_table(table, _SLOT, path, problems)
        for required in ("name", "upstream", "models"):
            if isinstance(table, dict) and required not in table:
                problems.append(f"{path}.{required}: is required")
        if "models" in good:
            good["models"] = _string_list(good["models"], f"{path}.models", problems)
        if "command" in good:
            good["command"] = _string_list(good["command"], f"{path}.command", problems)
        upstream = good.get("upstream")
        if isinstance(upstream, str) and not upstream.startswith(("http://", "https://")):
            problems.append(f"{path}.upstream: {upstream!r} must start with http:// or https://")
        name = good.get("name")
        if isinstance(name, str):
            if not name:
                problems.append(f"{path}.name: must not be empty")
            elif name in names:
                problems.append(f"{path}.name: {name!r} is used by another slot")
            names.add(name)
        _check_lifecycle(good, table, path, problems)
        for key, choices in (("anthropic", ANTHROPIC_MODES), ("responses", RESPONSES_MODES),
                             ("kind", SLOT_KINDS)):
            _one_of(good, key, choices, path, problems)
        if "api_key" in good and "api_key_env" in good:
            problems.append(f"{path}: set api_key or api_key_env, not both")
        for model in good.get("models") or ():
            if model in served:
                problems.append(
                    f"{path}.models: {model!r} is already served by slot {served[model]!r}"
                )
            served[model] = str(name)
        if len(problems) == before:
            good["upstream"] = good["upstream"].rstrip("/")
            slots.append(SlotConfig(**_with_free_port(good, base_dir)))
        elif isinstance(name, str) and name:
            problems[before:] = [f'{problem} (slot "{name}")' for problem in problems[before:]]
    return tuple(slots)


def _one_of(good: dict[str, Any], key: str, choices: tuple[str, ...], path: str,
            problems: list[str]) -> bool:
    """Whether `key`, when given, is one of `choices` (the first is its default); a problem
    naming it when not."""
    if key not in good or good[key] in choices:
        return True
    problems.append(f"{path}.{key}: {good[key]!r} is not one of {choices!r}")
    return False


def _check_lifecycle(good: dict[str, Any], table: Any, path: str, problems: list[str]) -> None:
    start = good.get("start", START_ALWAYS)
    if start not in (START_ALWAYS, START_ON_DEMAND):
        problems.append(f"{path}.start: {start!r} is not one of ('always', 'on_demand')")
    if good.get("command") or (isinstance(table, dict) and "command" in table):
        return  # a command given, if malformed, has its own problem: no follow-ons from it
    # Without a command hal0d has nothing to start or stop: these would silently do nothing.
    if start == START_ON_DEMAND:
        problems.append(f"{path}.start: 'on_demand' needs a command for hal0d to start")
    for key in LIFECYCLE_KEYS:
        if isinstance(table, dict) and key in table:
            problems.append(f"{path}.{key}: only for a slot with a command (hal0d starts it)")


def _check_groups(
    raw: Any, slots: tuple[SlotConfig, ...], problems: list[str], raw_slots: Any = ()
) -> dict[str, GroupConfig]:
    if not isinstance(raw, dict):
        problems.append("groups: must be a table of [groups.NAME] tables")
        return {}
    groups: dict[str, GroupConfig] = {}
    for name, table in raw.items():
        where = f"groups.{name}"
        good = _check_table(table, _GROUP, where, problems)
        if "free_memory_command" in good:
            good["free_memory_command"] = _string_list(
                good["free_memory_command"], f"{where}.free_memory_command", problems
            )
        if not _one_of(good, "policy", GROUP_POLICIES, where, problems):
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


def _check_routes(raw: Any, slots: tuple[SlotConfig, ...], problems: list[str]
                  ) -> tuple[RouteConfig, ...]:
    """The [[routes]] tables: a model no slot serves by itself, slots that exist (at least one),
    `served` naming only those slots."""
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
        good = _check_table(table, _ROUTE, path, problems)
        for required in ("model", "slots"):
            if isinstance(table, dict) and required not in table:
                problems.append(f"{path}.{required}: is required")
        model = good.get("model")
        if isinstance(model, str):
            if not model:
                problems.append(f"{path}.model: must not be empty")
            elif model in own:
                problems.append(f"{path}.model: {model!r} is already slot {own[model]!r}'s own "
                                "model; a route names a model no slot lists")
            elif model in seen:
                problems.append(f"{path}.model: {model!r} has another route")
            seen.add(model)
        if "slots" in good:
            listed = _string_list(good["slots"], f"{path}.slots", problems)
            if listed is not None:
                unknown = [name for name in listed if name not in names]
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
        if len(problems) == before:
            routes.append(RouteConfig(**good))
        elif isinstance(model, str) and model:
            problems[before:] = [f'{problem} (route "{model}")' for problem in problems[before:]]
    return tuple(routes)


def _check_models(raw: Any, slots: tuple[SlotConfig, ...], problems: list[str],
                  routes: tuple[RouteConfig, ...] = ()) -> dict[str, str]:
    if not isinstance(raw, dict):
        problems.append("models: must be a table of alias = served model")
        return {}
    served = {model for slot in slots for model in slot.models} | {r.model for r in routes}
    aliases: dict[str, str] = {}
    for pattern, target in raw.items():
        where = f"models.{pattern!r}" if not pattern.isidentifier() else f"models.{pattern}"
        if not isinstance(target, str):
            problems.append(f"{where}: {target!r} is not a string")
        elif slots and target not in served:
            problems.append(f"{where}: {target!r} is not a model any slot "
                            + ("or route serves" if routes else "serves"))
        else:
            aliases[pattern] = target
    return aliases


def _access_keys(server: dict[str, Any], base_dir: Path, problems: list[str]) -> None:
    """Check api_keys, read api_keys_file (one key per line; systemd's LoadCredential can
    supply it: `api_keys_file = "${CREDENTIALS_DIRECTORY}/hal0d-keys"`)."""
    keys: set[str] = set()
    listed = server.get("api_keys", [])
    if not all(isinstance(key, str) and key.strip() for key in listed):
        problems.append("server.api_keys: every key must be a non-empty string")
    else:
        server["api_keys"] = tuple(key.strip() for key in listed)
        keys.update(server["api_keys"])
    if "api_keys_file" in server:
        path = Path(os.path.expandvars(server["api_keys_file"]))
        path = path if path.is_absolute() else base_dir / path
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"server.api_keys_file: {str(path)!r} cannot be read ({exc})")
        else:
            found = {line.strip() for line in lines if line.strip() and not line.startswith("#")}
            if not found:
                problems.append(f"server.api_keys_file: {str(path)!r} holds no key")
            keys.update(found)
    server["accepted_keys"] = frozenset(keys)


def _check_keys(raw: Any, server: dict[str, Any], base_dir: Path, problems: list[str]
                ) -> tuple[KeyConfig, ...]:
    """The [[keys]] tables: a unique name, one secret source that yields a secret no other key
    has, at least one scope; each problem ends with the key's name when it has one."""
    if not isinstance(raw, list):
        problems.append("keys: must be an array of tables ([[keys]])")
        return ()
    keys: list[KeyConfig] = []
    names: set[str] = set()
    owners: dict[str, str] = {secret: "server.api_keys" for secret in
                              server.get("accepted_keys", ())}
    for index, table in enumerate(raw):
        path = f"keys[{index}]"
        before = len(problems)
        good = _check_table(table, _KEY, path, problems)
        name = good.get("name")
        if isinstance(table, dict) and "name" not in table:
            problems.append(f"{path}.name: is required")
        elif isinstance(name, str) and not name.strip():
            problems.append(f"{path}.name: must not be empty")
        elif isinstance(name, str):
            if name in names:
                problems.append(f"{path}.name: {name!r} is used by another key")
            names.add(name)
        scopes = good.get("scopes")
        if isinstance(table, dict) and "scopes" not in table:
            problems.append(f"{path}.scopes: is required (any of {', '.join(KEY_SCOPES)})")
        elif scopes is not None:
            if not scopes or not all(scope in KEY_SCOPES for scope in scopes):
                problems.append(f"{path}.scopes: {scopes!r} must list at least one of "
                                f"{', '.join(KEY_SCOPES)}")
            else:
                good["scopes"] = tuple(dict.fromkeys(scopes))
        if "models" in good:
            good["models"] = _string_list(good["models"], f"{path}.models", problems)
        secret = _key_secret(good, table, path, base_dir, problems)
        if secret is not None:
            if secret in owners:
                problems.append(f"{path}: its secret is also {owners[secret]}'s; every key "
                                "needs its own")
            owners.setdefault(secret, f"key {name!r}")
        if len(problems) == before:
            keys.append(KeyConfig(secret=secret or "", **good))
        elif isinstance(name, str) and name:
            problems[before:] = [f'{problem} (key "{name}")' for problem in problems[before:]]
    return tuple(keys)


def _key_secret(good: dict[str, Any], table: Any, path: str, base_dir: Path,
                problems: list[str]) -> str | None:
    """The secret from the key's one source, or None (and a problem) when it yields none."""
    given = [source for source in KEY_SECRET_SOURCES if isinstance(table, dict) and source in table]
    if len(given) != 1:
        problems.append(f"{path}: needs exactly one of {', '.join(KEY_SECRET_SOURCES)}"
                        + (f" (has {', '.join(given)})" if given else ""))
        return None
    source = given[0]
    if source not in good:
        return None  # malformed: its own problem is reported
    where = f"{path}.{source}"
    if source == "key":
        secret = good["key"].strip()
    elif source == "key_env":
        secret = os.environ.get(good["key_env"], "").strip()
        if not secret:
            problems.append(f"{where}: the environment variable {good['key_env']!r} is unset "
                            "or empty")
            return None
    else:
        file = Path(os.path.expandvars(good["key_file"]))
        file = file if file.is_absolute() else base_dir / file
        try:
            secret = file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(f"{where}: {str(file)!r} cannot be read ({exc})")
            return None
    if not secret:
        problems.append(f"{where}: the secret is empty")
        return None
    return secret


def _host_name(entry: Any) -> str | None:
    """An allowed_hosts entry as a request's Host is compared with it: lower-cased, an IPv6
    address without its brackets; None when it is no bare host name (a port, a scheme)."""
    if not isinstance(entry, str) or not entry.strip() or "/" in entry:
        return None
    name = entry.strip().lower()
    if name.startswith("[") and name.endswith("]"):
        return name[1:-1]
    return None if ":" in name else name


def _allowed_names(server: dict[str, Any], problems: list[str]) -> None:
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


def parse(raw: dict[str, Any], base_dir: Path | None = None) -> Config:
    """Validate a decoded TOML document; raise ConfigError listing every problem."""
    problems: list[str] = []
    known = {"server", "dispatcher", "slots", "groups", "models", "metrics", "logging", "keys",
             "routes", "ollama"}
    for key in raw:
        if key not in known:
            problems.append(f"{key}: unknown section (known: {', '.join(sorted(known))})")
    base_dir = base_dir or Path.cwd()
    server = _check_table(raw.get("server", {}), _SERVER, "server", problems)
    _access_keys(server, base_dir, problems)
    _allowed_names(server, problems)
    keys = _check_keys(raw.get("keys", []), server, base_dir, problems)
    dispatcher = _check_table(raw.get("dispatcher", {}), _DISPATCHER, "dispatcher", problems)
    metrics = _check_table(raw.get("metrics", {}), _METRICS, "metrics", problems)
    logging_ = _check_table(raw.get("logging", {}), _LOGGING, "logging", problems)
    if logging_.get("level", "info") not in _LOG_LEVELS:
        problems.append(f"logging.level: {logging_['level']!r} is not one of {_LOG_LEVELS}")
    if logging_.get("format", "auto") not in _LOG_FORMATS:
        problems.append(f"logging.format: {logging_['format']!r} is not one of {_LOG_FORMATS}")
    ollama = _check_ollama(raw.get("ollama", {}), server, problems)
    slots = _check_slots(raw.get("slots", []), problems, base_dir)
    raw_slots = raw.get("slots", [])
    groups = _check_groups(raw.get("groups", {}), slots, problems,
                           raw_slots if isinstance(raw_slots, list) else [])
    routes = _check_routes(raw.get("routes", []), slots, problems)
    models = _check_models(raw.get("models", {}), slots, problems, routes)
    for pattern in models:
        if not any(ch in pattern for ch in "*?[") and (
                any(pattern in s.models for s in slots) or any(pattern == r.model for r in routes)):
            problems.append(f"models.{pattern}: is already a served model name")
    if problems:
        raise ConfigError(problems)
    return Config(
        server=ServerConfig(**server),
        dispatcher=DispatcherConfig(**dispatcher),
        slots=slots,
        groups=groups,
        models=models,
        metrics=MetricsConfig(**metrics),
        logging=LoggingConfig(**logging_),
        keys=keys,
        routes=routes,
        ollama=OllamaConfig(**ollama),
        base_dir=base_dir,
    )


def _check_ollama(raw: Any, server: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """[ollama] listen: host:port, on a port of its own (not [server].port)."""
    good = _check_table(raw, _OLLAMA, "ollama", problems)
    listen = good.get("listen")
    if listen is None:
        return good
    address = split_address(listen)
    if address is None:
        problems.append(f"ollama.listen: {listen!r} is not host:port (e.g. \"127.0.0.1:11434\", "
                        "\"[::1]:11434\")")
        del good["listen"]
    elif address[1] == server.get("port", ServerConfig().port):
        problems.append(f"ollama.listen: port {address[1]} is [server].port's; the Ollama API "
                        "needs a port of its own")
        del good["listen"]
    return good


def load(path: str | Path) -> Config:
    path = Path(path)
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise ConfigError([f"{path}: cannot be read ({exc.strerror or exc})"]) from None
    try:
        raw = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 ({exc.reason})"]) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"{path}: invalid TOML ({exc})"]) from None
    metrics = raw.get("metrics")
    if (isinstance(metrics, dict) and "database" not in metrics) or "metrics" not in raw:
        # Named after the config file: two configs in one folder keep two histories.
        raw.setdefault("metrics", {})["database"] = default_database(path)
    return parse(raw, base_dir=path.resolve().parent)


def default_database(config_path: Path) -> str:
    """The history of a config file that names none: `two.toml` keeps `two.history.sqlite3`."""
    return f"{config_path.stem}.history.sqlite3"


def to_dict(config: Config) -> dict[str, Any]:
    def table(obj: Any) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for item in dataclasses.fields(obj):
            value = getattr(obj, item.name)
            if value is None or not item.repr:
                continue  # TOML has no null: an absent key means "not set"
            out[item.name] = list(value) if isinstance(value, tuple) else value
        return out

    doc: dict[str, Any] = {
        "server": table(config.server),
        "dispatcher": table(config.dispatcher),
        "metrics": table(config.metrics),
        "logging": table(config.logging),
    }
    if config.groups:
        doc["groups"] = {
            name: {k: v for k, v in table(group).items() if k != "name"}
            for name, group in config.groups.items()
        }
    if config.models:
        doc["models"] = dict(config.models)
    doc["slots"] = [slot_table(slot, table(slot)) for slot in config.slots]
    if config.keys:
        doc["keys"] = [table(key) for key in config.keys]
    if config.routes:
        doc["routes"] = [table(route) for route in config.routes]
    if config.ollama.listen is not None:
        doc["ollama"] = table(config.ollama)
    return doc


def slot_table(slot: SlotConfig, keys: dict[str, Any]) -> dict[str, Any]:
    """A slot's keys as print-config shows them: the lifecycle keys only where they can apply
    (a slot without a command refuses them, so the output must parse again)."""
    if not slot.command:
        for key in LIFECYCLE_KEYS:
            keys.pop(key, None)
    return keys


def to_toml(config: Config) -> str:
    return tomli_w.dumps(to_dict(config))


def alias_target(aliases: dict[str, str], model: str) -> str | None:
    """The served model an alias pattern maps `model` to; exact names win over globs."""
    if model in aliases:
        return aliases[model]
    for pattern, target in aliases.items():
        if fnmatch.fnmatchcase(model, pattern):
            return target
    return None
