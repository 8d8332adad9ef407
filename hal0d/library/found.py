"""What a scan of a model store hands back: the models it found (`FoundModel`) and, for every
file, folder or manifest that could not become one, a line the user can act on (`Problem`).

Every scanner (folder.py, ollama_store.py, hf_cache.py) returns a `Scan`, a pair of these lists,
and catalog.py merges scans. The two things every scanner asks of a file live here as well:
whether it starts with the GGUF magic, and (by default) whether its name says it is a vision
projector. Anything deeper about a GGUF file (its header, whether it is whole) is another
module's business: a scan must stay quick on a folder of thousands of files, so it reads no
more of a file than its first four bytes.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias

GGUF_MAGIC = b"GGUF"

# Decides whether a GGUF file is a vision projector (an mmproj) rather than a model.
IsProjector: TypeAlias = Callable[[Path], bool]


@dataclass(frozen=True, slots=True)
class FoundModel:
    """One model a store holds, under every name it answers to (the first is its main name).

    `parts` are the model's file(s) as found, split parts in order, not resolved: a link in a
    folder stays the link, so a user recognises the path. `identity` is what makes two finds
    one model (the real path of the first part): the same file reached through a link, under
    two Ollama tags or from a folder and the Hugging Face cache is one model, not two.
    """

    names: tuple[str, ...]
    source: str
    parts: tuple[Path, ...]
    mmproj: Path | None
    identity: str
    size_bytes: int


@dataclass(frozen=True, slots=True)
class Problem:
    """Why one file, folder or manifest of a source is not served; never fatal for the rest."""

    source: str
    path: str
    what: str

    def __str__(self) -> str:
        return f"{self.source}: {self.path}: {self.what}"


Scan: TypeAlias = tuple[list[FoundModel], list[Problem]]


def projector_by_name(path: Path) -> bool:
    """The default projector test: llama.cpp's converters and the Hugging Face repos that ship
    one name it `mmproj-...gguf` or `...mmproj...gguf`; a reader of GGUF headers can do better
    (general.type), and callers that have one hand it in instead."""
    return "mmproj" in path.name.lower()


def gguf_magic_problem(path: Path) -> str | None:
    """None when `path` starts with the GGUF magic, else why it cannot be served."""
    try:
        with open(path, "rb") as file:
            head = file.read(len(GGUF_MAGIC))
    except OSError as error:
        return f"cannot be read: {error.strerror or error}"
    if head != GGUF_MAGIC:
        return "not a GGUF file (it does not start with the GGUF magic)"
    return None


def identity_of(path: Path) -> str:
    return os.path.realpath(path)


def shown(path: Path, root: Path) -> str:
    """`path` as a Problem shows it: relative to the source's root when below it."""
    try:
        relative = path.relative_to(root)
    except ValueError:
        return str(path)
    return relative.as_posix() or "."
