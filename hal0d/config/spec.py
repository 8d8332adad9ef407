"""What each TOML table may hold, and the one check of a table against it.

A key's type and range are written once, in a table per section; `check_table` reads a table
by it and reports every bad key with its path (`slots[0].max_queue: ...`) instead of stopping
at the first, so `hal0d check-config` can list them all. The section checks (checks.py,
client_keys.py) add only what a table cannot say: required keys, names that must be unique,
references between sections.
"""

from __future__ import annotations

import math
from typing import Any, cast

from hal0d.config.duration import DURATION_EXAMPLES, go_duration
from hal0d.config.model import POLICY_BATCH, POLICY_FIFO, SLOT_TIMEOUT_KEYS, DispatcherConfig

# Per key: (type, minimum, maximum); None means unbounded. Floats accept integers too, and a
# float `*_s` key (seconds) a duration as Ollama's keep_alive takes one ("5m", "1h30m").
Range = tuple[type, float | None, float | None]
SERVER_SPEC: dict[str, Range] = {
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
    "anonymous": (dict, None, None),
}
DISPATCHER_SPEC: dict[str, Range] = {
    "direct_read_timeout_s": (float, 30.0, 600.0),
    "stream_total_timeout_s": (float, 0.0, 86400.0),
    "stream_idle_timeout_s": (float, 0.0, 86400.0),
    "connect_timeout_s": (float, 0.1, 600.0),
    "write_timeout_s": (float, 0.1, 600.0),
    "pool_timeout_s": (float, 0.1, 600.0),
    "keepalive_s": (float, 0.0, 3600.0),
    "batch_max_wait_s": (float, 0.0, 86400.0),
    "share_window_s": (float, 10.0, 86400.0),
}
# Keys that bound nothing, by their path: refused at any value but their default, saying why.
# The default loads, so a file print-config wrote (it writes every key) still parses.
NO_EFFECT: dict[str, tuple[float, str]] = {
    "dispatcher.pool_timeout_s": (
        DispatcherConfig().pool_timeout_s,
        "has no effect: hal0d's upstream pool has no connection limit, so a request never "
        "waits for a connection (it waits for its slot, in the slot's queue: queue_timeout_s); "
        "remove the key",
    ),
}
SLOT_SPEC: dict[str, Range] = {
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
    "context": (int, 1, 1 << 24),
    **{key: DISPATCHER_SPEC[key] for key in SLOT_TIMEOUT_KEYS},  # the same ranges, per slot
    "start": (str, None, None),
    "idle_unload_s": (float, 0.0, 30 * 86400.0),
    "load_timeout_s": (float, 1.0, 86400.0),
    "group": (str, None, None),
    "memory_mib": (int, 1, 1 << 30),
    "devices": (list, None, None),
    "anthropic": (str, None, None),
    "responses": (str, None, None),
    "kind": (str, None, None),
    "prompt_cache": (str, None, None),
    "save_timeout_s": (float, 0.1, 600.0),
    "prompt_cache_max_mib": (int, 1, 1 << 30),
    "capabilities": (object, None, None),  # a list or a table: config/capabilities.py
}
SLOT_KINDS = ("openai", "hal0d")
ANTHROPIC_MODES = ("translate", "native", "auto")
RESPONSES_MODES = ("native", "translate", "auto")
GROUP_SPEC: dict[str, Range] = {
    "max_loaded": (int, 1, 4096),
    "memory_mib": (int, 1, 1 << 30),
    "free_memory_command": (list, None, None),
    "policy": (str, None, None),
    "max_swap_share": (float, 0.01, 0.9),
    "max_wait_s": (float, 0.1, 3600.0),
    "min_turn_loads": (float, 0.0, 100.0),
}
ROUTE_SPEC: dict[str, Range] = {
    "model": (str, None, None),
    "slots": (list, None, None),
    "served": (dict, None, None),
    "first_byte_timeout_s": (float, 0.0, 3600.0),
    "spill_when_busy": (bool, None, None),
    "prefer_loaded": (bool, None, None),
}
# A key's (or a listener's anonymous) share of the box (hal0d/shares); `class` and a zero
# `weight` are checked by config/client_keys.check_share, to name what is wrong.
SHARE_SPEC: dict[str, Range] = {
    "class": (str, None, None),
    "weight": (float, 0.0, 1000.0),
    "tokens_per_hour": (int, 1, 1 << 50),
    "tokens_per_day": (int, 1, 1 << 50),
}
KEY_SPEC: dict[str, Range] = {
    "name": (str, None, None),
    "key": (str, None, None),
    "key_env": (str, None, None),
    "key_file": (str, None, None),
    "scopes": (list, None, None),
    "models": (list, None, None),
    "max_concurrent": (int, 1, 100_000),
    "requests_per_minute": (int, 1, 1_000_000),
    **SHARE_SPEC,
}
GROUP_POLICIES = (POLICY_BATCH, POLICY_FIFO)
METRICS_SPEC: dict[str, Range] = {
    "database": (str, None, None),
    "retention_days": (int, 1, 36500),
    "ttft_samples": (int, 1, 1_000_000),
}
DEVICES_SPEC: dict[str, Range] = {
    "devices_command": (list, None, None),
    "margin_mib": (int, 0, 1 << 20),
    "margins_mib": (dict, None, None),
    "read_interval_s": (float, 0.5, 3600.0),
}
LOGGING_SPEC: dict[str, Range] = {
    "level": (str, None, None),
    "format": (str, None, None),
}
OLLAMA_SPEC: dict[str, Range] = {
    "listen": (str, None, None),
    "truncate": (bool, None, None),
    "anonymous": (dict, None, None),
}
# A listener's `anonymous` table ([server], [ollama]): client_keys.check_anonymous.
ANONYMOUS_SPEC: dict[str, Range] = {
    "scopes": (list, None, None),
    "models": (list, None, None),
    "networks": (list, None, None),
    **SHARE_SPEC,
}
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("auto", "console", "json", "journald", "logfmt")


def _type_name(kind: type) -> str:
    return {
        str: "a string", int: "an integer", float: "a number", list: "a list", bool: "a boolean",
        dict: "a table", object: "a list or a table",
    }[kind]


def check_table(
    raw: Any, spec: dict[str, Range], path: str, problems: list[str]
) -> dict[str, Any]:
    """Return the valid keys of one table; append a problem for every bad one."""
    if not isinstance(raw, dict):
        problems.append(f"{path}: must be a table")
        return {}
    good: dict[str, Any] = {}
    value: Any
    for key, written in raw.items():
        where = f"{path}.{key}"
        if key not in spec:
            problems.append(f"{where}: unknown key (known: {', '.join(spec)})")
            continue
        kind, low, high = spec[key]
        seconds = kind is float and key.endswith("_s")
        value = _duration(written, where, problems) if seconds else written
        if value is None:
            continue
        shown = f"{written!r} ({value!r} s)" if isinstance(written, str) and seconds else ""
        # bool is an int in Python; a TOML `true` is never a number here.
        if (isinstance(value, bool) and kind is not bool) or not (
            isinstance(value, kind) or (kind is float and isinstance(value, int))
        ):
            also = f' or a duration ({DURATION_EXAMPLES})' if seconds else ""
            problems.append(f"{where}: {value!r} is not {_type_name(kind)}{also}")
            continue
        checked: Any = float(cast(float, value)) if kind is float else value
        if kind is float and not math.isfinite(checked):
            problems.append(f"{where}: {checked!r} is not a finite number")
            continue
        if low is not None and high is not None and not (low <= checked <= high):
            problems.append(f"{where}: {shown or repr(checked)} is outside {low}-{high}")
            continue
        if where in NO_EFFECT and checked != NO_EFFECT[where][0]:
            problems.append(f"{where}: {checked!r} {NO_EFFECT[where][1]}")
            continue
        good[key] = checked
    return good


def _duration(value: Any, where: str, problems: list[str]) -> Any:
    """A seconds key's value: a duration string read as its seconds, anything else as it is
    (its type is checked next); None, with a problem, for a string that is no duration."""
    if not isinstance(value, str):
        return value
    seconds = go_duration(value)
    if seconds is None:
        problems.append(f"{where}: {value!r} is not a duration ({DURATION_EXAMPLES}) nor a "
                        "number of seconds")
    return seconds


def string_list(value: list[Any], where: str, problems: list[str]) -> tuple[str, ...] | None:
    if not value or not all(isinstance(item, str) and item for item in value):
        problems.append(f"{where}: must be a non-empty list of non-empty strings")
        return None
    return tuple(value)


def one_of(good: dict[str, Any], key: str, choices: tuple[str, ...], path: str,
           problems: list[str]) -> bool:
    """Whether `key`, when given, is one of `choices` (the first is its default); a problem
    naming it when not."""
    if key not in good or good[key] in choices:
        return True
    problems.append(f"{path}.{key}: {good[key]!r} is not one of {choices!r}")
    return False
