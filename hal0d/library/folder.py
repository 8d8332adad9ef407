"""The models in a folder of GGUF files, the way a homelab keeps them (`/srv/models`), named by
their path below it: `qwen/Qwen3-8B-Q4_K_M.gguf` is `qwen/Qwen3-8B-Q4_K_M`.

The folder is searched recursively and links are followed (to files and to folders), since
people link models in from other disks; each real folder is read once, so a folder reached
through two links is not listed twice and a link back to a folder above it (a loop) is reported,
never followed for ever. Names starting with a dot are skipped, as are files not ending in
`.gguf`. A `.gguf` file is checked for the GGUF magic (its first four bytes) and nothing more.

Within one folder:
- split files `NAME-00001-of-00003.gguf` (llama.cpp's gguf-split) are one model, parts in
  order, named NAME; with a part missing the model is reported and skipped;
- a vision projector (`is_projector`; by default an `mmproj` in the file name) is not a model:
  it goes with the only model of its folder, else with the model whose name shares the longest
  prefix with its own once `mmproj` and separators are taken out. When several models share that
  longest prefix (Q4_K_M and Q8_0 of one model beside one `mmproj-...-f16.gguf`) it goes with
  each of them: quantizations of one model use the same projector. A projector that goes with no
  model is reported.

The Hugging Face cache's snapshots are folders of the same kind: hf_cache.py reads them with
`find_in_folder`, which names by the path below the folder it is given and shows the paths of
its problems below another.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hal0d.library.catalog import merge
from hal0d.library.found import (
    FoundModel,
    IsProjector,
    Problem,
    Scan,
    gguf_magic_problem,
    identity_of,
    projector_by_name,
    shown,
)

SUFFIX = ".gguf"
SPLIT_STEM = re.compile(r"^(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})$")
# What is taken out of names before a projector's is compared with its folder's models'.
SEPARATORS = re.compile(r"[-_. ]+")


@dataclass(frozen=True, slots=True)
class GgufFile:
    """A `.gguf` file of one folder: where it was found, and its size (through any link)."""

    path: Path
    size: int


def scan_folder(root: Path, is_projector: IsProjector = projector_by_name) -> Scan:
    """The models below `root`, named by their path relative to it."""
    return merge(find_in_folder(root, f"folder {root}", root, is_projector))


def find_in_folder(top: Path, source: str, shown_from: Path,
                   is_projector: IsProjector = projector_by_name) -> Scan:
    """Every model below `top`, named by its path below `top` (not yet merged: a file reached
    through a link and directly is two finds); problems show paths relative to `shown_from`."""
    walk = _Walk(top, source, shown_from)
    finds: list[FoundModel] = []
    for prefix, files in walk.folders():
        models, problems = _models_of_folder(prefix, files, walk, is_projector)
        finds += models
        walk.problems += problems
    return finds, walk.problems


class _Walk:
    """The folders below a top folder, each real folder once, with what went wrong on the way.

    An explicit stack rather than recursion: a deep tree cannot exhaust Python's stack.
    """

    def __init__(self, top: Path, source: str, shown_from: Path) -> None:
        self.top, self.source, self.shown_from = top, source, shown_from
        self.problems: list[Problem] = []

    def problem(self, path: Path, what: str) -> None:
        self.problems.append(Problem(self.source, shown(path, self.shown_from), what))

    def folders(self) -> Iterator[tuple[str, list[GgufFile]]]:
        """(a folder's path below the top with a trailing "/" or "", its `.gguf` files)."""
        try:
            top = os.stat(self.top)
        except OSError as error:
            self.problems.append(Problem(self.source, str(self.top), _unreadable(error)))
            return
        if not stat.S_ISDIR(top.st_mode):
            self.problems.append(Problem(self.source, str(self.top), "not a folder"))
            return
        visited = {_key(top)}
        # Each folder with the folders above it (real identity -> path), to tell a loop from a
        # folder merely reached twice.
        stack: list[tuple[Path, str, dict[tuple[int, int], Path]]] = [
            (self.top, "", {_key(top): self.top})]
        while stack:
            folder, prefix, above = stack.pop()
            files: list[GgufFile] = []
            below: list[tuple[Path, str, dict[tuple[int, int], Path]]] = []
            for path, info in self._entries(folder):
                if stat.S_ISREG(info.st_mode):
                    files.append(GgufFile(path, info.st_size))
                    continue
                key = _key(info)
                if key in above:
                    self.problem(path, f"a symlink loop: it leads back to "
                                       f"{shown(above[key], self.shown_from)}")
                elif key not in visited:
                    visited.add(key)
                    below.append((path, f"{prefix}{path.name}/", {**above, key: path}))
            yield prefix, files
            stack.extend(reversed(below))

    def _entries(self, folder: Path) -> Iterator[tuple[Path, os.stat_result]]:
        """The folder's subfolders and `.gguf` files, by name, through links; dot-names and
        other files left out; a folder or link that cannot be read reported."""
        try:
            with os.scandir(folder) as listing:
                names = sorted(entry.name for entry in listing)
        except OSError as error:
            self.problem(folder, f"this folder {_unreadable(error)}")
            return
        for name in names:
            if name.startswith("."):
                continue
            path = folder / name
            try:
                info = os.stat(path)
            except OSError as error:
                if what := self._unstatable(path, error):
                    self.problem(path, what)
                continue
            if stat.S_ISDIR(info.st_mode) or (
                    stat.S_ISREG(info.st_mode) and name.lower().endswith(SUFFIX)):
                yield path, info

    @staticmethod
    def _unstatable(path: Path, error: OSError) -> str | None:
        """Why an entry that cannot be followed is reported; None to pass it by (a dangling
        link that names no `.gguf`: there is no telling what it was)."""
        if error.errno == errno.ELOOP:
            return "a symlink loop"
        if isinstance(error, FileNotFoundError) and os.path.islink(path):
            if not path.name.lower().endswith(SUFFIX):
                return None
            try:
                target = os.readlink(path)
            except OSError:  # gone between the two looks: as missing as its target
                target = "a file"
            return f"a link to {target}, which is missing"
        return _unreadable(error)


def _key(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _unreadable(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "does not exist"
    return f"cannot be read: {error.strerror or error}"


def _models_of_folder(prefix: str, files: list[GgufFile], walk: _Walk,
                      is_projector: IsProjector) -> Scan:
    """The models of one folder's `.gguf` files, their projectors paired with them."""
    problems: list[Problem] = []

    def problem(path: Path, what: str) -> None:
        problems.append(Problem(walk.source, shown(path, walk.shown_from), what))

    models: list[GgufFile] = []
    projectors: list[GgufFile] = []
    for file in files:
        if what := gguf_magic_problem(file.path):
            problem(file.path, what)
            continue
        try:
            projector = is_projector(file.path)
        except Exception as error:  # a collaborator's failure is this file's problem only
            problem(file.path, f"cannot tell whether it is a projector: {error}")
            continue
        (projectors if projector else models).append(file)
    grouped: list[tuple[str, list[GgufFile]]] = []
    for stem, parts, missing in _split_groups(models):
        if missing:
            problem(parts[0].path, missing)
        else:
            grouped.append((stem, parts))
    paired, unpaired = pair_projectors([stem for stem, _ in grouped],
                                       [file.path for file in projectors])
    problems += [Problem(walk.source, shown(path, walk.shown_from), what)
                 for path, what in unpaired]
    finds = [FoundModel(names=(f"{prefix}{stem}",), source=walk.source,
                        parts=tuple(part.path for part in parts), mmproj=paired.get(index),
                        identity=identity_of(parts[0].path),
                        size_bytes=sum(part.size for part in parts))
             for index, (stem, parts) in enumerate(grouped)]
    return finds, problems


def _split_groups(models: list[GgufFile]) -> Iterator[tuple[str, list[GgufFile], str | None]]:
    """(name, parts in order, why it is incomplete or None) for each model of a folder: a
    whole file is a model of one part; split files are grouped by name and part count."""
    splits: dict[tuple[str, int], dict[int, GgufFile]] = {}
    for file in models:
        stem = file.path.name[: -len(SUFFIX)]
        if match := SPLIT_STEM.match(stem):
            group = splits.setdefault((match["base"], int(match["count"])), {})
            group[int(match["index"])] = file
        else:
            yield stem, [file], None
    for (base, count), found in sorted(splits.items()):
        expected = range(1, count + 1)
        missing = [index for index in expected if index not in found]
        parts = [found[index] for index in sorted(found)]
        if missing or len(found) != count:
            names = ", ".join(f"{base}-{index:05d}-of-{count:05d}{SUFFIX}" for index in missing)
            why = (f"split model {base}: part(s) {names} missing; not served" if missing
                   else f"split model {base}: parts beyond {count} found; not served")
            yield base, parts, why
        else:
            yield base, parts, None


def pairing_key(stem: str) -> str:
    """A name as it is compared for pairing: lower case, `mmproj` and separators taken out."""
    return SEPARATORS.sub("", stem.lower().replace("mmproj", ""))


def common_prefix(one: str, other: str) -> int:
    """How many characters `one` and `other` share from their start."""
    length = 0
    for mine, theirs in zip(one, other, strict=False):
        if mine != theirs:
            break
        length += 1
    return length


def pair_projectors(model_stems: list[str], projectors: list[Path]
                    ) -> tuple[dict[int, Path], list[tuple[Path, str]]]:
    """The projector of each model (by its index in `model_stems`), and each projector that
    goes with no model, with why. A model two projectors choose takes the closer by name (the
    first by name on a tie)."""
    keys = [pairing_key(stem) for stem in model_stems]
    chosen: dict[int, tuple[int, Path]] = {}  # model -> (shared prefix, projector)
    unpaired: list[tuple[Path, str]] = []
    wanted: list[Path] = []
    for projector in sorted(projectors):
        key = pairing_key(projector.name[: -len(SUFFIX)])
        shared = [common_prefix(key, model) for model in keys]
        if not shared:
            unpaired.append((projector, "a projector (mmproj) with no model in its folder"))
            continue
        best = max(shared)
        if best == 0 and len(keys) > 1:
            unpaired.append((projector, f"a projector (mmproj) whose name shares nothing with "
                                        f"the {len(keys)} models of its folder"))
            continue
        wanted.append(projector)
        for index, length in enumerate(shared):
            held = chosen.get(index)
            if length == best and (held is None or length > held[0]):
                chosen[index] = (length, projector)
    paired = {index: projector for index, (_, projector) in chosen.items()}
    used = set(paired.values())
    unpaired += [(projector, "a projector (mmproj) not used: its model is paired with one "
                             "whose name is closer")
                 for projector in wanted if projector not in used]
    return paired, unpaired
