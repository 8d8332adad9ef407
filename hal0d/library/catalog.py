"""One list of models out of several scans: the same file found twice is one model under all its
names, and a name two different models claim goes to the one found first.

The order of the scans is the user's order of preference: a name claimed by a folder's model and
by a Hugging Face model, with the folder listed first, stays the folder's, and the later model
answers only to its other names (a Problem says so); a model left with no name is dropped. The
scanners run their own finds through `merge` too, so a file reached twice within one store (a
link beside its target, one Ollama blob under two tags) is one model there as well.

The result is deterministic: models in the order of their first find (the scans in order, each
scan's finds by path), names in the order they were claimed, problems as the scans reported
them, then the conflicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from hal0d.library.found import FoundModel, Problem, Scan


@dataclass(slots=True)
class _Model:
    """A model being merged: its first find, and the names it has won so far."""

    first: FoundModel
    names: list[str] = field(default_factory=list)
    mmproj: Path | None = None


def merge(*scans: Scan) -> Scan:
    """The models of `scans` joined by identity, each name kept by its first claimant."""
    models: dict[str, _Model] = {}
    owners: dict[str, FoundModel] = {}  # name -> the find that claimed it first
    conflicts: list[tuple[FoundModel, str]] = []
    for finds, _ in scans:
        # Sorted by path so the order does not hang on the file system's listing order; stable,
        # so a scanner's own order of finds of one file (Ollama's manifests) is kept.
        for find in sorted(finds, key=lambda find: str(find.parts[0])):
            model = models.setdefault(find.identity, _Model(find))
            model.mmproj = model.mmproj or find.mmproj
            for name in find.names:
                owner = owners.setdefault(name, find)
                if owner.identity != find.identity:
                    conflicts.append((find, name))
                elif name not in model.names:
                    model.names.append(name)
    problems = [problem for _, found in scans for problem in found]
    problems += [_conflict(find, name, owners[name], models[find.identity])
                 for find, name in conflicts]
    merged = [replace(model.first, names=tuple(model.names), mmproj=model.mmproj)
              for model in models.values() if model.names]
    return merged, problems


def _conflict(find: FoundModel, name: str, owner: FoundModel, loser: _Model) -> Problem:
    fate = ("it has no other name and is not served" if not loser.names
            else f"it is served as {loser.names[0]}")
    return Problem(find.source, str(find.parts[0]),
                   f"{name}: also named by {owner.source}: {owner.parts[0]} "
                   f"(kept: that one; {fate})")
