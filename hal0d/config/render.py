"""The effective configuration as TOML, for `hal0d print-config`: every default filled in.

What it prints must parse again to the same configuration, so a key that is not set is left out
(TOML has no null), the secrets are left out (a field kept out of repr is kept out here too),
and a slot without a command shows none of the lifecycle keys it would refuse.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import tomli_w

from hal0d.config.model import LIFECYCLE_KEYS, ON_DEMAND_KEYS, Config, SlotConfig


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
    (a slot without a command refuses them, an 'always' slot its idle unload, so the output must
    parse again)."""
    keys.pop("prompt_cache_dir", None)  # what {prompt_cache_dir} stood for, in the command
    if not slot.command:
        for key in LIFECYCLE_KEYS:
            keys.pop(key, None)
    if not slot.on_demand:
        for key in ON_DEMAND_KEYS:
            keys.pop(key, None)
    return keys


def to_toml(config: Config) -> str:
    return tomli_w.dumps(to_dict(config))
