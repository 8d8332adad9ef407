"""`{prompt_cache_dir}` in a slot's command: the folder hal0d keeps for that slot's saved prompt
caches (llama-server: `--slot-save-path {prompt_cache_dir}`).

The folder is named after the slot and a digest of what decides what the saved caches mean, so
a file is only ever restored into the model and the command that saved it (llama-server reads a
cache saved under other weights of the same shape, or another context size, without complaint,
and then answers wrongly):

- the command as written;
- the identity (size, modification time, inode) of each model file it names (`-m`, `--model`,
  `-md`, `--mmproj`, ... for any program): a GGUF replaced at the same path is other weights;
- the `LLAMA_*` environment variables hal0d runs with, which the command inherits
  (`LLAMA_ARG_*` set llama-server's options, `LLAMA_CACHE` where `-hf` models are kept).

Any change gets a new folder, and the old one is deleted (lifecycle/prompt_cache.py sweeps
them). The root
sits beside the history database, which is where hal0d keeps its state (under systemd the
unit's StateDirectory, so the caches survive a restart of hal0d and a reboot).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from stat import S_ISREG
from typing import Any, Final

from hal0d.config.slot_command import option_values

PROMPT_CACHE_DIR = "{prompt_cache_dir}"
# The options that name a file of weights, whichever program reads them (llama-server's model,
# draft model, multimodal projector and LoRA adapters; vLLM's and llama-cpp-python's --model).
WEIGHTS_OPTIONS: Final = ("-m", "--model", "-md", "--model-draft", "-mm", "--mmproj",
                          "--lora", "--lora-scaled", "--control-vector")
# The environment variables the command inherits from hal0d that change what it loads.
ENV_PREFIX: Final = "LLAMA_"


def cache_root(database: Path) -> Path:
    """Where the prompt caches of the hal0d whose history is `database` live: `history.sqlite3`
    keeps `prompt-cache/` beside it, `two.history.sqlite3` keeps `two.prompt-cache/`."""
    stem = database.name.removesuffix(".sqlite3").removesuffix("history").rstrip(".")
    return database.parent / (f"{stem}.prompt-cache" if stem else "prompt-cache")


def command_digest(command: Sequence[str], environ: Mapping[str, str] | None = None) -> str:
    """A short digest of a command as written (before any placeholder is filled in), the
    identity of the weights it names, and the `LLAMA_*` variables of `environ` (hal0d's own
    environment when not given)."""
    environ = os.environ if environ is None else environ
    key = {"command": list(command),
           "weights": [weights_identity(path) for _, path in option_values(
               list(command[1:]), WEIGHTS_OPTIONS)],
           "env": sorted((name, value) for name, value in environ.items()
                         if name.startswith(ENV_PREFIX))}
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]


def weights_identity(path: str) -> list[Any]:
    """What tells one file of weights from another at the same path: its size, modification
    time and inode (through a symlink, the file it names); the path alone when there is no file
    to read (a Hugging Face name, a placeholder, a file not there yet, a folder)."""
    try:
        stat = os.stat(path)
    except (OSError, ValueError):
        return [path]
    if not S_ISREG(stat.st_mode):
        return [path]
    return [path, stat.st_size, stat.st_mtime_ns, stat.st_ino, stat.st_dev]


def slot_cache_dir(root: Path, slot: str, command: Sequence[str]) -> Path:
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
