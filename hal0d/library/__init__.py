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

gguf_facts.py (and slots.py, which uses it) load numpy: they are imported where a config has a
[[library]] table, not from here.
"""

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
    "hf_root",
    "merge",
    "ollama_roots",
    "projector_by_name",
    "scan_folder",
    "scan_hf",
    "scan_ollama",
]
