"""The model library: the models a machine already has, found where people keep them, named,
read from the files themselves, and served as slots of their own ([[library]] in the config).

Plain synchronous file-system code, quick on thousands of files; bad input never raises, it
becomes a Problem line and the rest is served. Inside, one module a concern:
  found.py        what a scan returns (FoundModel, Problem) and the GGUF magic check
  folder.py       a folder of GGUF files, searched recursively: split parts, projectors, links
  ollama_store.py Ollama's store (manifests and blobs), named as Ollama names its models
  hf_cache.py     the Hugging Face cache (refs, snapshots, blobs), named after the repository
  catalog.py      several scans merged: one model per file, each name kept by its first finder
  gguf_facts.py   what a GGUF file says about itself (architecture, size, quantization, context,
                  attention shape, chat template) and the memory it takes under llama-server
  slots.py        the models the [[library]] tables find, as slot tables
  view.py         what was found, as GET /api/library and `hal0d models` show it

gguf_facts.py (and slots.py, which uses it) load numpy: `find_models`, the finder a config is
read with to be served, imports them on a config's first [[library]] table, not before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hal0d.config.library import Found
from hal0d.config.model import LibraryConfig
from hal0d.library.catalog import merge
from hal0d.library.folder import scan_folder
from hal0d.library.found import FoundModel, IsProjector, Problem, Scan, projector_by_name
from hal0d.library.hf_cache import hf_root, scan_hf
from hal0d.library.ollama_store import ollama_roots, scan_ollama

__all__ = [
    "FoundModel",
    "IsProjector",
    "Problem",
    "Scan",
    "find_models",
    "hf_root",
    "merge",
    "ollama_roots",
    "projector_by_name",
    "scan_folder",
    "scan_hf",
    "scan_ollama",
]


def find_models(libraries: tuple[LibraryConfig, ...], taken_names: set[str],
                taken_slots: set[str], groups: Any, base_dir: Path) -> Found:
    """The models the [[library]] tables find, as slot tables (slots.py): the `ModelFinder`
    (config/library.py) that `config.load(path, find_models=...)` is handed."""
    from hal0d.library.slots import library_slots

    return library_slots(libraries, taken_names, taken_slots, groups, base_dir)
