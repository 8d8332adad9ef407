"""The GGUF models in the Hugging Face cache (what `hf download`, `huggingface_hub` and the tools
built on it leave on disk), named after their repository: `Qwen/Qwen3-8B-GGUF:Qwen3-8B-Q4_K_M`.

The cache's layout, as huggingface_hub documents it:

    <cache>/models--<org>--<repo>/refs/main            the commit `main` was at, as text
    <cache>/models--<org>--<repo>/snapshots/<commit>/  the files of that commit, as links
                                                       into ../../blobs/<hash>
    <cache>/models--<org>--<repo>/blobs/<hash>         the downloaded files

The snapshot read is the one refs/main names, else the newest (by modification time). It is read
as a folder of GGUF files (folder.py: split parts, projectors, links), so the rules are the same
in both places. A link whose blob is missing (an interrupted download, a cleaned blob) is
reported. A model is named `ORG/REPO:STEM`, STEM its file name without `.gguf` and without a
split suffix (for a file in a subfolder of the snapshot, the file's own stem), and also
`ORG/REPO` when it is the only model of the snapshot. Datasets, spaces and anything else in the
cache are passed by.

Why not huggingface_hub's `scan_cache_dir`: it would bring requests, tqdm, fsspec, pyyaml and the
compiled hf-xet wheel into a daemon that only needs to list a few folders; the layout above is
documented and stable, and reading it is a few lines.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from hal0d.library.catalog import merge
from hal0d.library.folder import find_in_folder
from hal0d.library.found import (
    FoundModel,
    IsProjector,
    Problem,
    Scan,
    projector_by_name,
    shown,
)

REPO_PREFIX = "models--"
MAIN_REF = Path("refs") / "main"
# A commit id is 40 hex digits; a ref file much longer than that is not one.
REF_MAX_BYTES = 256


def hf_root() -> Path:
    """Where the Hugging Face cache is, by huggingface_hub's own rules: $HF_HUB_CACHE (its
    older name $HUGGINGFACE_HUB_CACHE), else $HF_HOME/hub, else
    $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub. It may not exist."""
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if value := os.environ.get(variable):
            return _expanded(value)
    if home := os.environ.get("HF_HOME"):
        return _expanded(home) / "hub"
    return _expanded(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "huggingface" / "hub"


def _expanded(value: str) -> Path:
    return Path(os.path.expandvars(os.path.expanduser(value)))


def scan_hf(root: Path, is_projector: IsProjector = projector_by_name) -> Scan:
    """The GGUF models of the Hugging Face cache at `root`."""
    source = f"hf {root}"
    try:
        with os.scandir(root) as listing:
            repos = sorted(entry.name for entry in listing if entry.name.startswith(REPO_PREFIX))
    except OSError as error:
        what = "does not exist" if isinstance(error, FileNotFoundError) else (
            f"cannot be read: {error.strerror or error}")
        return [], [Problem(source, str(root), what)]
    finds: list[FoundModel] = []
    problems: list[Problem] = []
    for name in repos:
        repo_id = name.removeprefix(REPO_PREFIX).replace("--", "/")
        snapshot, why = _snapshot(root / name)
        if why:
            problems.append(Problem(source, shown(root / name, root), why))
        if snapshot is None:
            continue
        found, trouble = find_in_folder(snapshot, source, root, is_projector)
        finds += _named(found, repo_id)
        problems += trouble
    return merge((finds, problems))


def _named(finds: list[FoundModel], repo_id: str) -> list[FoundModel]:
    """The finds of one snapshot, named after the repository rather than their path in it."""
    alone = len({find.identity for find in finds}) == 1
    named = []
    for find in finds:
        stem = find.names[0].rsplit("/", 1)[-1]
        names = (f"{repo_id}:{stem}", repo_id) if alone else (f"{repo_id}:{stem}",)
        named.append(replace(find, names=names))
    return named


def _snapshot(repo: Path) -> tuple[Path | None, str | None]:
    """The snapshot to read: the one refs/main names, else the newest; None when there is none
    (a download that never finished a file). With why, when the snapshots cannot be read."""
    snapshots = repo / "snapshots"
    commit = _main_commit(repo)
    if commit and os.path.isdir(snapshots / commit):
        return snapshots / commit, None
    try:
        with os.scandir(snapshots) as listing:
            candidates = [(entry.stat().st_mtime_ns, entry.name) for entry in listing
                          if not entry.name.startswith(".") and entry.is_dir()]
    except FileNotFoundError:
        return None, None
    except OSError as error:
        return None, f"its snapshots cannot be read: {error.strerror or error}"
    if not candidates:
        return None, None
    return snapshots / max(candidates)[1], None


def _main_commit(repo: Path) -> str | None:
    """The commit refs/main names, when it names one plainly (no path in it)."""
    try:
        with open(repo / MAIN_REF, "rb") as file:
            commit = file.read(REF_MAX_BYTES).decode("ascii", "replace").strip()
    except OSError:
        return None
    if not commit or "/" in commit or commit.startswith("."):
        return None
    return commit
