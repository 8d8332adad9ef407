"""Reading a config file: TOML in, a checked `Config` out, or a `ConfigError` with every problem.

Every section is checked before anything fails, so `hal0d check-config` prints all that is wrong
at once and nothing starts half-configured; a reload reads the file the same way, and a config
that fails leaves the running one in place. `parse` is the same without the file, for a document
already decoded.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hal0d.config.anonymous import check_anonymous, check_beside_keys
from hal0d.config.cache_dir import cache_root
from hal0d.config.checks import (
    allowed_names,
    broken_routes,
    broken_slots,
    check_devices,
    check_groups,
    check_models,
    check_ollama,
    check_routes,
    check_slots,
)
from hal0d.config.client_keys import access_keys, check_keys
from hal0d.config.library import Found, ModelFinder, check_library
from hal0d.config.model import (
    Config,
    ConfigError,
    DevicesConfig,
    DispatcherConfig,
    GroupConfig,
    LibraryConfig,
    LoggingConfig,
    MetricsConfig,
    OllamaConfig,
    ServerConfig,
    SlotConfig,
)
from hal0d.config.spec import (
    DISPATCHER_SPEC,
    LOG_FORMATS,
    LOG_LEVELS,
    LOGGING_SPEC,
    METRICS_SPEC,
    SERVER_SPEC,
    check_table,
)


def parse(raw: dict[str, Any], base_dir: Path | None = None,
          find_models: ModelFinder | None = None) -> Config:
    """Validate a decoded TOML document; raise ConfigError listing every problem.
    `find_models`: what scans the [[library]] sources (hal0d/library/slots.py's
    `library_slots`, handed in by whoever reads a config to serve it); without it their models
    are not among the slots, for a command that only needs the server's address."""
    problems: list[str] = []
    known = {"server", "dispatcher", "slots", "groups", "models", "metrics", "logging", "keys",
             "routes", "ollama", "library", "devices"}
    for key in raw:
        if key not in known:
            problems.append(f"{key}: unknown section (known: {', '.join(sorted(known))})")
    base_dir = base_dir or Path.cwd()
    server = check_table(raw.get("server", {}), SERVER_SPEC, "server", problems)
    access_keys(server, base_dir, problems)
    allowed_names(server, problems)
    if "anonymous" in server:
        server["anonymous"] = check_anonymous(server["anonymous"], "server.anonymous",
                                              server.get("host", ServerConfig().host), problems)
    keys = check_keys(raw.get("keys", []), server, base_dir, problems)
    dispatcher = check_table(raw.get("dispatcher", {}), DISPATCHER_SPEC, "dispatcher", problems)
    metrics = check_table(raw.get("metrics", {}), METRICS_SPEC, "metrics", problems)
    logging_ = checked_logging(raw, problems)
    ollama = check_ollama(raw.get("ollama", {}), server, problems)
    devices = check_devices(raw.get("devices", {}), problems)
    has_keys = bool(server.get("accepted_keys")) or bool(raw.get("keys"))
    check_beside_keys({"server.anonymous": server.get("anonymous"),
                       "ollama.anonymous": ollama.get("anonymous")}, has_keys, keys, problems)
    database = Path(metrics.get("database", MetricsConfig().database))
    slotted = checked_slots(raw, base_dir, cache_root(
        database if database.is_absolute() else base_dir / database), problems, find_models)
    slots, groups, tables, found = slotted
    broken = broken_slots(tables, slots)
    routes = check_routes(raw.get("routes", []), slots, problems, broken)
    models = check_models(raw.get("models", {}), slots, problems, routes,
                          broken | broken_routes(raw.get("routes", []), routes))
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
        library=found.libraries,
        devices=DevicesConfig(**devices),
        library_problems=tuple(found.problems),
        base_dir=base_dir,
    )


def checked_logging(raw: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    logging_ = check_table(raw.get("logging", {}), LOGGING_SPEC, "logging", problems)
    if logging_.get("level", "info") not in LOG_LEVELS:
        problems.append(f"logging.level: {logging_['level']!r} is not one of {LOG_LEVELS}")
    if logging_.get("format", "auto") not in LOG_FORMATS:
        problems.append(f"logging.format: {logging_['format']!r} is not one of {LOG_FORMATS}")
    return logging_


@dataclass(frozen=True, slots=True)
class Libraries:
    """The [[library]] tables and what their sources hold that is not served."""

    libraries: tuple[LibraryConfig, ...]
    problems: list[str]


SlotsChecked = tuple[tuple[SlotConfig, ...], dict[str, GroupConfig], list[Any], Libraries]


def checked_slots(raw: dict[str, Any], base_dir: Path, caches: Path, problems: list[str],
                  find_models: ModelFinder | None) -> SlotsChecked:
    """The [[slots]] and the slots of the models the [[library]] tables find (`find_models`),
    then the [groups] they name; with the slot tables as written (the found ones made)."""
    raw_slots = raw.get("slots", [])
    library = check_library(raw.get("library", []), raw.get("groups", {}), problems)
    found = (models_found(raw, library, base_dir, find_models)
             if library and find_models is not None else None)
    slots = check_slots(raw_slots, problems, base_dir, caches, found.tables if found else ())
    if found:
        slots = tuple(dataclasses.replace(slot, library=found.entries[slot.name])
                      if slot.name in found.entries else slot for slot in slots)
    tables = raw_slots if isinstance(raw_slots, list) else []
    tables = tables + [table for _, table in found.tables] if found else tables
    # A group a library names is not "named by no slot" while its sources hold no model.
    claimed = tables + [dict(entry.defaults) for entry in library]
    groups = check_groups(raw.get("groups", {}), slots, problems, claimed)
    return slots, groups, tables, Libraries(library, found.problems if found else [])


def models_found(raw: dict[str, Any], library: tuple[LibraryConfig, ...], base_dir: Path,
                 find_models: ModelFinder) -> Found:
    """The slots of the models the [[library]] tables find, beside what the file writes by
    hand: a name a slot, a route or an alias serves, and a slot's name, stay theirs."""

    def tables(section: str) -> list[dict[str, Any]]:
        given = raw.get(section)
        return [table for table in given if isinstance(table, dict)] if isinstance(
            given, list) else []

    slots = tables("slots")
    aliases = raw.get("models")
    taken = {model for table in slots if isinstance(table.get("models"), list)
             for model in table["models"]}
    taken |= {route.get("model") for route in tables("routes")}
    taken |= set(aliases) if isinstance(aliases, dict) else set()
    return find_models(library, {name for name in taken if isinstance(name, str)},
                       {str(table.get("name")) for table in slots}, raw.get("groups"), base_dir)


def load(path: str | Path, find_models: ModelFinder | None = None) -> Config:
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
    return parse(raw, base_dir=path.resolve().parent, find_models=find_models)


def default_database(config_path: Path) -> str:
    """The history of a config file that names none: `two.toml` keeps `two.history.sqlite3`."""
    return f"{config_path.stem}.history.sqlite3"
