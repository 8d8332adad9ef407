"""The effective configuration as TOML, for `hal0d print-config`: every default filled in.

What it prints parses again to the same configuration, so a key that is not set is left out
(TOML has no null) and a slot without a command shows none of the lifecycle keys it would
refuse. Secrets are the exception: print-config's output is pasted into issues and chats, so a
secret written in the file (a key's `key`, `[server] api_keys`, a slot's `api_key`) is printed
as REDACTED_SECRET, which check-config refuses until the secret is put back; one read from
elsewhere (`key_env`, `key_file`, `api_keys_file`, `api_key_env`) prints as it is written
and round-trips. A field kept out of repr (a secret as read) is kept out here too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import tomli_w

from hal0d.config.model import (
    LIFECYCLE_KEYS,
    ON_DEMAND_KEYS,
    REDACTED_SECRET,
    Config,
    KeyConfig,
    LibraryConfig,
    ServerConfig,
    SlotConfig,
)

# The fields that hold a secret as written in the file, by the table's type.
SECRET_FIELDS: dict[type, frozenset[str]] = {
    KeyConfig: frozenset({"key"}),
    ServerConfig: frozenset({"api_keys"}),
    SlotConfig: frozenset({"api_key"}),
}


def table(obj: Any) -> dict[str, Any]:
    """A dataclass's keys as TOML holds them: tuples as lists, a nested table as a table, the
    secrets redacted."""
    secrets = SECRET_FIELDS.get(type(obj), frozenset())
    out: dict[str, Any] = {}
    for item in dataclasses.fields(obj):
        value = getattr(obj, item.name)
        name = item.metadata.get("toml", item.name)  # `class`, a word Python keeps for itself
        if value is None or not item.repr:
            continue  # TOML has no null: an absent key means "not set"
        if item.name in secrets:
            value = [REDACTED_SECRET for _ in value] if isinstance(value, tuple) else (
                REDACTED_SECRET)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out[name] = table(value)
        elif isinstance(value, Mapping):  # TOML's keys are strings: { 1 = 2048 }
            out[name] = {str(key): entry for key, entry in value.items()}
        else:
            out[name] = list(value) if isinstance(value, tuple) else value
    return out


def to_dict(config: Config) -> dict[str, Any]:
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
    # A library's slots are its table's: printing them too would pin what a rescan finds.
    doc["slots"] = [slot_table(slot, table(slot)) for slot in config.slots
                    if slot.library is None]
    if config.library:
        doc["library"] = [library_table(library) for library in config.library]
    if config.keys:
        doc["keys"] = [table(key) for key in config.keys]
    if config.routes:
        doc["routes"] = [table(route) for route in config.routes]
    if config.ollama.listen is not None:
        doc["ollama"] = table(config.ollama)
    doc["devices"] = table(config.devices)
    return doc


def slot_table(slot: SlotConfig, keys: dict[str, Any]) -> dict[str, Any]:
    """A slot's keys as print-config shows them: the lifecycle keys only where they can apply
    (a slot without a command refuses them, an 'always' slot its idle unload, so the output must
    parse again)."""
    keys.pop("prompt_cache_dir", None)  # what {prompt_cache_dir} stood for, in the command
    if slot.capabilities:
        keys["capabilities"] = {model: list(names) for model, names in slot.capabilities}
    else:
        keys.pop("capabilities", None)
    if not slot.command:
        for key in LIFECYCLE_KEYS:
            keys.pop(key, None)
    if not slot.on_demand:
        for key in ON_DEMAND_KEYS:
            keys.pop(key, None)
    return keys


def library_table(library: LibraryConfig) -> dict[str, Any]:
    keys: dict[str, Any] = {"path": library.path, "context": library.context}
    if library.command is not None:
        keys["command"] = list(library.command)
    keys.update(library.defaults)
    return keys


def to_toml(config: Config) -> str:
    text = tomli_w.dumps(to_dict(config))
    if f'"{REDACTED_SECRET}"' in text:
        text = (f"# Secrets written in the file print as {REDACTED_SECRET}: put them back before "
                "loading this output\n# (check-config refuses it until then).\n" + text)
    return text
