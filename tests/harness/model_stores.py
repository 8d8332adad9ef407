"""Model stores on disk, laid out the way their owners write them, for the library's scanners:
a folder of GGUF files, Ollama's store (manifests and blobs) and the Hugging Face cache (refs,
snapshots of links, blobs). Each builder takes the bytes of every model file it writes.

`gguf()` stands in for a GGUF file: the magic and a little more, which is all the scanners read.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

MODEL_LAYER = "application/vnd.ollama.image.model"
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
TEMPLATE_LAYER = "application/vnd.ollama.image.template"
PARAMS_LAYER = "application/vnd.ollama.image.params"
CONFIG_TYPE = "application/vnd.docker.container.image.v1+json"
MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"


def gguf(tag: str = "") -> bytes:
    """Bytes that pass for a GGUF file (the magic, version 3), told apart by `tag`."""
    return b"GGUF" + (3).to_bytes(4, "little") + tag.encode()


def folder_of(root: Path, files: Mapping[str, bytes]) -> Path:
    """`root` holding each file of `files` (path below root -> bytes)."""
    for relative, data in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    return root


@dataclass(frozen=True)
class OllamaStore:
    """An Ollama store at `root`, written as Ollama's `pull` and `create` leave it."""

    root: Path

    def blob(self, data: bytes) -> dict[str, object]:
        """`data` as a blob; its layer fields (without the media type)."""
        digest = hashlib.sha256(data).hexdigest()
        path = self.root / "blobs" / f"sha256-{digest}"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        return {"digest": f"sha256:{digest}", "size": len(data)}

    def manifest_path(self, name: str) -> Path:
        """Where the manifest of `name` lives; `name` as Ollama's users write it (`qwen3:8b`,
        `jmorgan/tiny`, `hf.co/org/repo:Q4_K_M`), filled in as Ollama fills it."""
        rest, _, tag = name.rpartition(":") if ":" in name.rsplit("/", 1)[-1] else (
            name, "", "latest")
        parts = rest.split("/")
        parts = {1: ["registry.ollama.ai", "library"], 2: ["registry.ollama.ai"]}.get(
            len(parts), []) + parts
        return self.root.joinpath("manifests", *parts, tag)

    def write_manifest(self, name: str, text: str) -> Path:
        path = self.manifest_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def pull(self, name: str, model: bytes, *, projector: bytes | None = None,
             adapter: bytes | None = None, missing: bytes | None = None) -> Path:
        """A model as `ollama pull` leaves it: its weights, projector (and adapter) layers, a
        template, parameters, the config blob, and the manifest naming them. `missing` is a
        layer the manifest names as the model but whose blob is never written."""
        layers = [{"mediaType": MODEL_LAYER, **self.blob(model)}]
        if missing is not None:
            layers = [{"mediaType": MODEL_LAYER, "size": len(missing),
                       "digest": f"sha256:{hashlib.sha256(missing).hexdigest()}"}]
        if projector is not None:
            layers.append({"mediaType": PROJECTOR_LAYER, **self.blob(projector)})
        if adapter is not None:
            layers.append({"mediaType": ADAPTER_LAYER, **self.blob(adapter)})
        layers.append({"mediaType": TEMPLATE_LAYER, **self.blob(b"{{ .Prompt }}")})
        layers.append({"mediaType": PARAMS_LAYER, **self.blob(b'{"stop":["<|im_end|>"]}')})
        return self.write_manifest(name, self.manifest_text(layers))

    def manifest_text(self, layers: list[dict[str, object]]) -> str:
        """A manifest as Ollama's Go encoder writes it: compact JSON and a newline."""
        config = self.blob(json.dumps({"model_format": "gguf", "model_family": "llama",
                                       "file_type": "Q4_K_M", "os": "linux"}).encode())
        manifest = {"schemaVersion": 2, "mediaType": MANIFEST_TYPE,
                    "config": {"mediaType": CONFIG_TYPE, **config}, "layers": layers}
        return json.dumps(manifest, separators=(",", ":")) + "\n"


@dataclass(frozen=True)
class HfCache:
    """A Hugging Face cache at `root`, written as huggingface_hub's downloads leave it."""

    root: Path

    def repo(self, repo_id: str) -> Path:
        return self.root / ("models--" + repo_id.replace("/", "--"))

    def snapshot(self, repo_id: str, commit: str, files: Mapping[str, bytes | None], *,
                 main: bool = True, mtime: float | None = None) -> Path:
        """The snapshot `commit` of `repo_id`: each file (path in the repository -> bytes) a
        relative link into the repository's blobs, named by the bytes' sha256 as the Hub names
        large files; None for a link whose blob is missing. `main`: refs/main names it.
        `mtime`: the snapshot folder's modification time."""
        repo = self.repo(repo_id)
        snapshot = repo / "snapshots" / commit
        for relative, data in files.items():
            digest = hashlib.sha256(data if data is not None else relative.encode()).hexdigest()
            blob = repo / "blobs" / digest
            blob.parent.mkdir(parents=True, exist_ok=True)
            if data is not None:
                blob.write_bytes(data)
            link = snapshot / relative
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(os.path.relpath(blob, link.parent))
        snapshot.mkdir(parents=True, exist_ok=True)
        if main:
            (repo / "refs").mkdir(parents=True, exist_ok=True)
            (repo / "refs" / "main").write_text(commit)
        if mtime is not None:
            os.utime(snapshot, (mtime, mtime))
        return snapshot
