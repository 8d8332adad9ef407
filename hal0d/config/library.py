"""The `[[library]]` tables: sources of model files, each model found served by a slot made
from the table (hal0d/library/slots.py makes them; this module only checks the tables).

    [[library]]
    path = "/srv/models"        # a folder of GGUF files; "ollama" (its stores where they
                                # usually are) or an Ollama store's folder; "hf" (the
                                # Hugging Face cache) or a cache's folder
    group = "gpu"               # any slot key but name, upstream, models, kind and the
    idle_unload_s = 600         # upstream's key: the default of every model found here
    context = 16384             # {context}: this, or the model's own when smaller
    command = ["llama-server", "-m", "{model_path}", "--mmproj", "{mmproj}",
               "--alias", "{alias}", "--port", "{free_port}", "-c", "{context}"]

A slot key set here is checked as a slot's is, once, so a bad one is one problem and not one
per model found.

What the tables find is `Found`, made by a `ModelFinder` that the reader is handed
(hal0d/library/slots.py's `library_slots`): the library reads the config's tables, so the
config does not import the library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hal0d.config.cache_dir import PROMPT_CACHE_DIR
from hal0d.config.model import LIBRARY_CONTEXT, PROMPT_CACHE_SAVE, LibraryConfig, LibraryEntry
from hal0d.config.ports import FREE_PORT
from hal0d.config.spec import SLOT_SPEC, check_table, string_list

# The slot keys a library cannot set for its models: each model has its own name, upstream and
# model names, is an OpenAI-compatible server hal0d starts, and needs no key to be reached.
NOT_FOR_A_LIBRARY = ("name", "upstream", "models", "kind", "api_key", "api_key_env",
                     "capabilities")
LIBRARY_SPEC = {
    "path": (str, None, None),
    "context": (int, 256, 1 << 24),
    **{key: spec for key, spec in SLOT_SPEC.items() if key not in NOT_FOR_A_LIBRARY},
}
# What a library's command says per model (beside {free_port} and {prompt_cache_dir}).
MODEL_PATH = "{model_path}"
MMPROJ = "{mmproj}"
ALIAS = "{alias}"
CONTEXT = "{context}"


@dataclass(slots=True)
class Found:
    """What the libraries hold: the slot tables to check (with where each came from, for its
    problems), what each slot was made from (by slot name), and the lines of what is not
    served."""

    tables: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    entries: dict[str, LibraryEntry] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


# The libraries' models, given what is served otherwise: (the [[library]] tables, the model
# names hand-written slots, routes and aliases serve, the hand-written slots' names, the
# [groups] table as written, the config's folder) -> what they find.
ModelFinder = Callable[[tuple[LibraryConfig, ...], set[str], set[str], Any, Path], Found]


def check_library(raw: Any, groups: Any, problems: list[str]) -> tuple[LibraryConfig, ...]:
    """The [[library]] tables; `groups`: the [groups] table as written (a library's group must
    be one)."""
    if not isinstance(raw, list):
        problems.append("library: must be an array of tables ([[library]])")
        return ()
    libraries: list[LibraryConfig] = []
    for index, table in enumerate(raw):
        where = f"library[{index}]"
        before = len(problems)
        good = check_table(table, LIBRARY_SPEC, where, problems)
        if isinstance(table, dict) and "path" not in table:
            problems.append(f"{where}.path: is required (a folder, \"ollama\" or \"hf\")")
        if good.get("path") == "":
            problems.append(f"{where}.path: must not be empty")
        command = None
        if "command" in good:
            command = string_list(good.pop("command"), f"{where}.command", problems)
            _check_command(command or (), where, problems)
        if good.get("start") not in (None, "on_demand", "always"):
            problems.append(f"{where}.start: {good['start']!r} is not one of "
                            "('always', 'on_demand')")
        if good.get("start") == "always" and "idle_unload_s" in good:
            problems.append(f"{where}.idle_unload_s: only for start = 'on_demand' (an 'always' "
                            "model is kept up, never unloaded when idle)")
        if good.get("prompt_cache") == PROMPT_CACHE_SAVE and command is not None and not any(
                PROMPT_CACHE_DIR in arg for arg in command):
            problems.append(f"{where}.prompt_cache: 'save' needs {PROMPT_CACHE_DIR} in the "
                            "command (llama-server: --slot-save-path {PROMPT_CACHE_DIR})")
        group = good.get("group")
        if group is not None and (not isinstance(groups, dict) or group not in groups):
            defined = ", ".join(sorted(groups)) if isinstance(groups, dict) else ""
            problems.append(f"{where}.group: {group!r} is not a [groups] table (defined: "
                            f"{defined or 'none'})")
        if len(problems) > before:
            continue
        path = good.pop("path")
        context = good.pop("context", LIBRARY_CONTEXT)
        libraries.append(LibraryConfig(path=path, command=command, context=context,
                                       defaults=tuple(sorted(good.items()))))
    return tuple(libraries)


def _check_command(command: tuple[str, ...], where: str, problems: list[str]) -> None:
    """A library's command serves many models: it must name the model's file and a port of
    its own for each (two models on one fixed port could never both be loaded)."""
    if not command:
        return
    if not any(MODEL_PATH in arg for arg in command):
        problems.append(f"{where}.command: must name the model's file as {MODEL_PATH} (one "
                        "command serves every model found)")
    if not any(FREE_PORT in arg for arg in command):
        problems.append(f"{where}.command: must listen on {FREE_PORT} (each model found gets "
                        "a port of its own)")
