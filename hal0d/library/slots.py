"""The models the `[[library]]` tables find, as slot tables: each model a slot of its own, made
from its library's command and slot keys, checked afterwards exactly as a hand-written
`[[slots]]` table is (config/checks.py).

The rules a user meets:
- one slot per model file, under every name it was found by (one blob under two Ollama tags,
  a file in a folder and in the Hugging Face cache): never two processes for one file;
- a name a hand-written slot, route or `[models]` alias already serves stays theirs: a
  `[[slots]]` table is how one model found is given settings of its own;
- the slot's name is its model's main name with anything but letters, digits, `.`, `_` and
  `-` made `-` (a second slot of the same name gets `-2`);
- the command's placeholders: `{model_path}` (the first split part: llama-server finds the
  others), `{mmproj}` (the vision projector; without one, the argument and the option before
  it are left out), `{alias}` (the model's main name, so the server answers under it),
  `{context}` (the library's context, or the model's trained one when smaller);
- `memory_mib`, unless the library sets it, is the model's estimate (weights and KV cache at
  that context, from its GGUF header);
- a file that is no readable model, or that needs more memory than its group's whole budget,
  is a problem line, and the rest is served.

A library without `command` runs llama-server (found beside hal0d's Python or on PATH when the
process starts) with the defaults below.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from hal0d.config.cache_dir import PROMPT_CACHE_DIR
from hal0d.config.library import ALIAS, CONTEXT, MMPROJ, MODEL_PATH, Found
from hal0d.config.model import (
    LIBRARY_IDLE_UNLOAD_S,
    PROMPT_CACHE_SAVE,
    START_ON_DEMAND,
    LibraryConfig,
    LibraryEntry,
)
from hal0d.config.ports import FREE_PORT
from hal0d.library.catalog import merge
from hal0d.library.folder import scan_folder
from hal0d.library.found import FoundModel, Scan, projector_by_name
from hal0d.library.gguf_facts import UnreadableModel, read_facts
from hal0d.library.hf_cache import hf_root, scan_hf
from hal0d.library.ollama_store import ollama_roots, scan_ollama

DEFAULT_COMMAND = ("llama-server", "-m", MODEL_PATH, "--mmproj", MMPROJ, "--alias", ALIAS,
                   "--host", "127.0.0.1", "--port", FREE_PORT, "-c", CONTEXT, "--jinja")
SAVE_ARGS = ("--slot-save-path", PROMPT_CACHE_DIR)
UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def library_slots(libraries: Iterable[LibraryConfig], taken_names: set[str],
                  taken_slots: set[str], groups: Any, base_dir: Path) -> Found:
    """The slots of every model the libraries find. `taken_names`: the model names served
    otherwise (hand-written slots, routes, aliases); `taken_slots`: the hand-written slots'
    names; `groups`: the [groups] table as written (its budgets)."""
    found = Found()
    libraries = tuple(libraries)
    scans: list[Scan] = []
    owner: dict[str, int] = {}  # a model's identity: the first library that found it
    for index, library in enumerate(libraries):
        for scan in _scans(library, base_dir, found.problems, index):
            scans.append(scan)
            for model in scan[0]:
                owner.setdefault(model.identity, index)
    models, problems = merge(*scans)
    found.problems.extend(str(problem) for problem in problems)
    slot_names = set(taken_slots)
    for model in models:
        index = owner[model.identity]
        made = _slot_of(model, libraries[index], taken_names, slot_names, groups=groups,
                        problems=found.problems)
        if made is not None:
            table, entry = made
            found.tables.append((f'library[{index}] model "{model.names[0]}"', table))
            found.entries[table["name"]] = entry
            slot_names.add(table["name"])
    return found


def _scans(library: LibraryConfig, base_dir: Path, problems: list[str],
           index: int) -> list[Scan]:
    """The scans of the library's source, told by its path: "ollama", "hf", or a folder whose
    layout says what it is (an Ollama store has manifests/ and blobs/, a Hugging Face cache
    models--ORG--REPO folders)."""
    if library.path == "ollama":
        roots = ollama_roots()
        if not roots:
            problems.append(f"library[{index}]: no Ollama store found ($OLLAMA_MODELS, "
                            "~/.ollama/models, /usr/share/ollama/.ollama/models); give its path")
        return [scan_ollama(root) for root in roots]
    if library.path == "hf":
        return [scan_hf(hf_root(), projector_by_header)]
    root = Path(os.path.expandvars(library.path)).expanduser()
    root = root if root.is_absolute() else base_dir / root
    if (root / "manifests").is_dir() and (root / "blobs").is_dir():
        return [scan_ollama(root)]
    if (root / "hub").is_dir() and any((root / "hub").glob("models--*")):
        return [scan_hf(root / "hub", projector_by_header)]
    if any(root.glob("models--*")):
        return [scan_hf(root, projector_by_header)]
    return [scan_folder(root, projector_by_header)]


def projector_by_header(path: Path) -> bool:
    """A vision projector is what its GGUF header says it is (general.type "mmproj", or a
    CLIP architecture); a file whose header cannot be read is judged by its name."""
    try:
        return read_facts(path).is_projector
    except UnreadableModel:
        return projector_by_name(path)


def _slot_of(model: FoundModel, library: LibraryConfig, taken_names: set[str],
             slot_names: set[str], *, groups: Any, problems: list[str]
             ) -> tuple[dict[str, Any], LibraryEntry] | None:
    where = f"{model.source}: {model.parts[0]}"
    names = tuple(name for name in model.names if name not in taken_names)
    if not names:
        return None  # every name is served by a slot written by hand: that one wins
    try:
        facts = read_facts(model.parts[0], model.parts[1:])
        projector = read_facts(model.mmproj) if model.mmproj else None
    except UnreadableModel as exc:
        problems.append(f"{where}: {exc}")
        return None
    defaults = dict(library.defaults)
    context = min(library.context, facts.context_length or library.context)
    estimate = facts.estimate_mib(context, projector=projector)
    budget = _budget(groups, defaults.get("group"))
    given = defaults.get("memory_mib")
    memory = given if isinstance(given, int) else estimate
    if budget is not None and memory > budget:
        problems.append(f"{where}: needs about {memory} MiB at -c {context}, more than group "
                        f"{defaults['group']!r}'s whole budget ({budget} MiB): not served")
        return None
    name = _slot_name(names[0], slot_names)
    table: dict[str, Any] = {
        "name": name, "upstream": f"http://127.0.0.1:{FREE_PORT}", "models": list(names),
        "start": START_ON_DEMAND, **defaults, "memory_mib": memory,
        "command": _filled(_command(library, defaults), model, names[0], context),
    }
    if table["start"] == START_ON_DEMAND:
        table.setdefault("idle_unload_s", LIBRARY_IDLE_UNLOAD_S)
    entry = LibraryEntry(
        names=names, source=model.source, file=str(model.parts[0]),
        mmproj=str(model.mmproj) if model.mmproj else None, size_bytes=facts.file_bytes,
        modified_at=_modified_at(model.parts[0]), family=facts.family,
        parameters=facts.parameters, parameter_size=facts.parameter_size,
        quantization=facts.quantization, trained_context=facts.context_length,
        context=context, estimate_mib=estimate,
        chat_template=facts.chat_template,
        table=tuple(table.items()))
    return table, entry


def _command(library: LibraryConfig, defaults: dict[str, Any]) -> tuple[str, ...]:
    if library.command is not None:
        return library.command
    saves = defaults.get("prompt_cache") == PROMPT_CACHE_SAVE
    return DEFAULT_COMMAND + (SAVE_ARGS if saves else ())


def _filled(command: tuple[str, ...], model: FoundModel, alias: str, context: int) -> list[str]:
    out: list[str] = []
    for arg in command:
        if MMPROJ in arg and model.mmproj is None:
            if arg == MMPROJ and out and out[-1].startswith("-"):
                out.pop()  # `--mmproj {mmproj}` without a projector: neither
            continue
        out.append(arg.replace(MODEL_PATH, str(model.parts[0]))
                   .replace(MMPROJ, str(model.mmproj)).replace(ALIAS, alias)
                   .replace(CONTEXT, str(context)))
    return out


def _slot_name(model_name: str, taken: set[str]) -> str:
    base = UNSAFE.sub("-", model_name).strip("-.") or "model"
    name, number = base, 2
    while name in taken:
        name, number = f"{base}-{number}", number + 1
    return name


def _budget(groups: Any, group: Any) -> int | None:
    table = groups.get(group) if isinstance(groups, dict) and isinstance(group, str) else None
    budget = table.get("memory_mib") if isinstance(table, dict) else None
    return budget if isinstance(budget, int) else None


def _modified_at(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0

