"""The models Ollama has pulled, read from its store on disk, named as Ollama's users name them,
so a homelab that moves to hal0d keeps its models and the names its clients already send.

The store, as Ollama writes it (OLLAMA_MODELS, else ~/.ollama/models of the user it runs as):

    manifests/<host>/<namespace>/<model>/<tag>    one JSON manifest a name
    blobs/sha256-<hex>                            the layers, named by their digest

A manifest (schemaVersion 2) lists `layers`, each with a `mediaType`, a `digest`
("sha256:<hex>") and a `size`. The weights are the layer of type
`application/vnd.ollama.image.model` (a GGUF file); a vision model's projector is a layer of type
`application/vnd.ollama.image.projector`. Ollama reads exactly four levels below `manifests/`
and skips a path whose parts are not a valid name; so do we.

Names, as `ollama list` shows them and as Ollama resolves what a client sends:
    registry.ollama.ai/library/qwen3/8b           qwen3:8b
    registry.ollama.ai/library/qwen3/latest       qwen3:latest, qwen3
    registry.ollama.ai/jmorgan/tiny/q4            jmorgan/tiny:q4
    hf.co/bartowski/Llama-3.2-1B-GGUF/Q4_K_M      hf.co/bartowski/Llama-3.2-1B-GGUF:Q4_K_M
A name whose tag is `latest` also answers without it (Ollama fills in `latest` when a client
leaves the tag out, whatever the host and namespace).

Not served, each with a Problem: a manifest that is not JSON or not a manifest, one with no
model layer (a cloud model, or weights in a format other than GGUF), one with a LoRA adapter
layer (its weights alone would answer differently than Ollama does under that name), and one
naming a blob that is missing. One blob under two tags is one model with both names.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

from hal0d.library.catalog import merge
from hal0d.library.found import FoundModel, Problem, Scan, gguf_magic_problem, identity_of

MODEL_LAYER = "application/vnd.ollama.image.model"
PROJECTOR_LAYER = "application/vnd.ollama.image.projector"
ADAPTER_LAYER = "application/vnd.ollama.image.adapter"
DEFAULT_HOST = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
DEFAULT_TAG = "latest"
# Ollama's own rule for a digest it will turn into a blob's file name.
DIGEST = re.compile(r"^sha256[:-](?P<hex>[0-9a-fA-F]{64})$")
# Ollama's rules for the parts of a name (types/model/name.go): a letter, digit or underscore
# first; then the namespace takes `-` and `_`, the model and the tag `.` as well, the host `:`
# too (a port).
NAME_PARTS = (
    ("host", re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:-]{0,349}$")),
    ("namespace", re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]{0,79}$")),
    ("model", re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}$")),
    ("tag", re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,79}$")),
)
# A manifest is a few hundred bytes; anything far bigger is not one, and is not read whole.
MANIFEST_MAX_BYTES = 1 << 20
# Where Ollama keeps its store when OLLAMA_MODELS is not set: the home of the user it runs as.
# /usr/share/ollama is the home its Linux install script gives the `ollama` user its systemd
# service runs as; /var/lib/ollama is the home some distributions' packages give it instead
# (NixOS's module keeps the store in its `models` folder directly).
SERVICE_STORES = (Path("/usr/share/ollama/.ollama/models"),
                  Path("/var/lib/ollama/.ollama/models"),
                  Path("/var/lib/ollama/models"))


def ollama_roots() -> list[Path]:
    """The Ollama stores of this machine that exist: $OLLAMA_MODELS, ~/.ollama/models, then
    the service's own; each real folder once, in that order."""
    candidates: list[Path] = []
    if configured := os.environ.get("OLLAMA_MODELS"):
        candidates.append(Path(configured).expanduser())
    candidates += [Path.home() / ".ollama" / "models", *SERVICE_STORES]
    roots: list[Path] = []
    seen: set[str] = set()
    for candidate in candidates:
        real = os.path.realpath(candidate)
        if real not in seen and os.path.isdir(candidate):
            seen.add(real)
            roots.append(candidate)
    return roots


def scan_ollama(root: Path) -> Scan:
    """The models of the Ollama store at `root`."""
    source = f"ollama {root}"
    manifests = root / "manifests"
    if not os.path.isdir(manifests):
        what = "no manifests folder: not an Ollama model store" if os.path.isdir(root) else (
            "is not a folder this user can read")
        return [], [Problem(source, str(root), what)]
    finds: list[FoundModel] = []
    problems: list[Problem] = []
    for parts, unreadable in _manifest_paths(manifests):
        shown = "/".join(("manifests", *parts))
        if unreadable:
            problems.append(Problem(source, shown, unreadable))
            continue
        find, why = _model_of(root, parts, source)
        if why:
            problems.append(Problem(source, shown, why))
        if find:
            finds.append(find)
    return merge((finds, problems))


def names_of(host: str, namespace: str, model: str, tag: str) -> tuple[str, ...]:
    """The names Ollama's users give the manifest at host/namespace/model/tag, shortest first
    (Ollama's own list shows the first)."""
    if host.lower() != DEFAULT_HOST:
        base = f"{host}/{namespace}/{model}"
    elif namespace.lower() != DEFAULT_NAMESPACE:
        base = f"{namespace}/{model}"
    else:
        base = model
    return (f"{base}:{tag}", base) if tag == DEFAULT_TAG else (f"{base}:{tag}",)


def _manifest_paths(manifests: Path) -> list[tuple[tuple[str, ...], str | None]]:
    """The (host, namespace, model, tag) of each manifest file, exactly four levels down as
    Ollama reads them, by path; with why, for a folder that cannot be read on the way."""
    found: list[tuple[tuple[str, ...], str | None]] = []
    level: list[tuple[str, ...]] = [()]
    for depth in range(4):
        deeper: list[tuple[str, ...]] = []
        for parts in level:
            try:
                with os.scandir(manifests.joinpath(*parts)) as listing:
                    entries = sorted((entry.name, entry.is_dir()) for entry in listing
                                     if not entry.name.startswith("."))
            except OSError as error:
                found.append((parts, f"this folder cannot be read: {error.strerror or error}"))
                continue
            # The last level holds the manifests (files); the ones above, folders.
            deeper += [(*parts, name) for name, is_dir in entries if is_dir == (depth < 3)]
        level = deeper
    found += [(parts, None) for parts in level]
    return sorted(found)


def _model_of(root: Path, parts: tuple[str, ...], source: str
              ) -> tuple[FoundModel | None, str | None]:
    """The model a manifest names, or why there is none."""
    for (kind, rule), part in zip(NAME_PARTS, parts, strict=True):
        if not rule.match(part):
            return None, f"{part!r} is not a valid {kind} in an Ollama name; Ollama skips it too"
    manifest, why = _read_manifest(root.joinpath("manifests", *parts))
    if manifest is None:
        return None, why
    layers = manifest["layers"]
    types = [layer["mediaType"] for layer in layers]
    if MODEL_LAYER not in types:
        return None, ("no model layer (a cloud model, or weights Ollama keeps in another format "
                      "than GGUF): not served")
    if ADAPTER_LAYER in types:
        return None, ("has a LoRA adapter layer, which hal0d does not apply; not served, as its "
                      "base weights alone would answer differently")
    # Ollama takes the last model layer and every projector; llama-server takes one projector.
    model = [layer for layer in layers if layer["mediaType"] == MODEL_LAYER][-1]
    projectors = [layer for layer in layers if layer["mediaType"] == PROJECTOR_LAYER]
    blob, size, why = _blob(root, model["digest"])
    if blob is None:
        return None, why
    mmproj = None
    if projectors:
        mmproj, _, why = _blob(root, projectors[0]["digest"])
        if mmproj is None:
            return None, why
    if why := gguf_magic_problem(blob):
        return None, f"model blob {blob.name}: {why}"
    find = FoundModel(names=names_of(*parts), source=source, parts=(blob,), mmproj=mmproj,
                      identity=identity_of(blob), size_bytes=size)
    extra = (f"has {len(projectors)} projector layers; hal0d passes the first"
             if len(projectors) > 1 else None)
    return find, extra


def _read_manifest(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The manifest at `path` if it is one (JSON with `layers`, each with a string
    `mediaType` and `digest`), else why not."""
    try:
        with open(path, "rb") as file:
            text = file.read(MANIFEST_MAX_BYTES + 1)
    except OSError as error:
        return None, f"cannot be read: {error.strerror or error}"
    if len(text) > MANIFEST_MAX_BYTES:
        return None, "far too big to be a manifest; not read"
    try:
        manifest = json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        return None, f"not a manifest Ollama can read (not JSON: {error})"
    layers = manifest.get("layers") if isinstance(manifest, dict) else None
    if not isinstance(layers, list) or not all(
            isinstance(layer, dict) and isinstance(layer.get("mediaType"), str)
            and isinstance(layer.get("digest"), str) for layer in layers):
        return None, "not a manifest Ollama can read (no list of layers with types and digests)"
    return manifest, None


def _blob(root: Path, digest: str) -> tuple[Path | None, int, str | None]:
    """The blob file a layer's digest names and its size, or why it cannot be used."""
    match = DIGEST.match(digest)
    if not match:
        return None, 0, f"names a layer by {digest!r}, which is not a sha256 digest"
    blob = root / "blobs" / f"sha256-{match['hex']}"
    try:
        info = os.stat(blob)
    except OSError as error:
        what = "is missing" if isinstance(error, FileNotFoundError) else (
            f"cannot be read ({error.strerror or error})")
        return None, 0, f"names blob sha256-{match['hex'][:12]}... which {what}"
    if not stat.S_ISREG(info.st_mode):
        return None, 0, f"names blob sha256-{match['hex'][:12]}... which is not a file"
    return blob, info.st_size, None
