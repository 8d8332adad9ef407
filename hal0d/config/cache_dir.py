"""`{prompt_cache_dir}` in a slot's command: the folder hal0d keeps for that slot's saved prompt
caches (llama-server: `--slot-save-path {prompt_cache_dir}`).

The folder is named after the slot and a digest of its command as written, so a file is only
ever restored into the model and the command that saved it (a cache saved under another model,
or another context size, would be read without complaint and answer wrongly): a changed command
gets a new folder, and the old one is deleted (lifecycle/prompt_cache.py sweeps them). The root
sits beside the history database, which is where hal0d keeps its state (under systemd the
unit's StateDirectory, so the caches survive a restart of hal0d and a reboot).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

PROMPT_CACHE_DIR = "{prompt_cache_dir}"


def cache_root(database: Path) -> Path:
    """Where the prompt caches of the hal0d whose history is `database` live: `history.sqlite3`
    keeps `prompt-cache/` beside it, `two.history.sqlite3` keeps `two.prompt-cache/`."""
    stem = database.name.removesuffix(".sqlite3").removesuffix("history").rstrip(".")
    return database.parent / (f"{stem}.prompt-cache" if stem else "prompt-cache")


def command_digest(command: tuple[str, ...] | list[str]) -> str:
    """A short digest of a command as written (before any placeholder is filled in)."""
    return hashlib.sha256(json.dumps(list(command)).encode()).hexdigest()[:16]


def slot_cache_dir(root: Path, slot: str, command: tuple[str, ...] | list[str]) -> Path:
    return root / slot / command_digest(command)


def with_prompt_cache_dir(good: dict[str, Any], root: Path) -> dict[str, Any]:
    """A slot whose command names PROMPT_CACHE_DIR gets its folder there and in
    `prompt_cache_dir`; the folder is created when the process is launched, not here (a
    check-config must not write anything)."""
    command = good.get("command") or ()
    if not any(PROMPT_CACHE_DIR in arg for arg in command):
        return good
    folder = str(slot_cache_dir(root, good["name"], command))
    good["prompt_cache_dir"] = folder
    good["command"] = tuple(arg.replace(PROMPT_CACHE_DIR, folder) for arg in command)
    return good
