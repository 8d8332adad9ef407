"""What the [[library]] tables found, as `GET /api/library` and `hal0d models` show it: each
model's names, source, file, size, quantization, context, estimated memory, group, slot and
(from a running hal0d) state, and the lines of what is not served. Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hal0d.config.model import Config


def library_view(config: Config, states: Mapping[str, str] | None) -> dict[str, Any]:
    """`states`: each slot's state, from the daemon that serves them (None: not known)."""
    models = []
    for slot in config.slots:
        entry = slot.library
        if entry is None:
            continue
        models.append({
            "names": list(entry.names), "slot": slot.name, "source": entry.source,
            "file": entry.file, "mmproj": entry.mmproj, "size_bytes": entry.size_bytes,
            "family": entry.family, "parameter_size": entry.parameter_size,
            "quantization": entry.quantization, "trained_context": entry.trained_context,
            "context": entry.context, "estimate_mib": entry.estimate_mib,
            "memory_mib": slot.memory_mib, "group": slot.group,
            "state": None if states is None else states.get(slot.name),
        })
    return {"sources": [library.path for library in config.library], "models": models,
            "problems": list(config.library_problems)}
