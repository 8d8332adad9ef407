"""A slot's prompt caches, kept across a stop: saved before hal0d stops its process, restored
after the next load, before the first request is admitted.

llama-server started with `--slot-save-path DIR` saves what one of its server slots has read
into a file of DIR and reads it back into a slot (its README: `GET /slots`, where a slot that
holds a prompt has `n_prompt_tokens`; `POST /slots/{id}?action=save` and `action=restore` with
`{"filename": ...}`). Restored, a conversation's next turn reads only its new tokens: on two
CPU cores a 1,355-token conversation's next turn took 0.10 s instead of 3.15 s after a restart.

The folder is the slot's `{prompt_cache_dir}` (config/cache_dir.py: one per slot and command, so
a file is only restored into what saved it). Beside the server's files hal0d writes a manifest:
which server slot each file is of, how many tokens it holds, when it was saved, and which
conversations (conversations.py) the slot held, so that a restore gives them back their
affinity, after a restart of hal0d too.

Saving and restoring never fail or hold a request: each is bounded by `save_timeout_s`; a
failure is logged with its cause and counted, and the load goes on cold. The manifest is
dropped when its files may be gone or wrong (a save that failed after asking the server to write
one, a restore the server refused: nothing half saved is ever restored); a save that failed
before any file was touched keeps the last good one.

The folders are hal0d's alone: a symlink found where a slot's folder or a command's folder
should be is never followed, neither to create the folder nor by the sweep (someone else's
folder would be written or deleted); it is logged and left, and the slot does not load.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

import orjson
from aiohttp import hdrs

from hal0d.config import SlotConfig
from hal0d.config.cache_dir import command_digest
from hal0d.errors import UpstreamUnavailable, upstream_message
from hal0d.lifecycle.process import LaunchFailed
from hal0d.logs import get_logger
from hal0d.transport.upstream import UpstreamClient

log = get_logger()

MANIFEST: Final = "hal0d-manifest.json"
MIB: Final = 1024 * 1024
# The folder names a command's digest gives (config/cache_dir.py): the sweep deletes only those.
DIGEST_LENGTH: Final = 16


class Warmth(Protocol):
    """What the lifecycle tells of the conversations a slot holds warm (conversations.Affinity)."""

    def conversations(self, slot: str) -> list[str]: ...

    def warm(self, slot: str) -> int: ...

    def forget_slot(self, slot: str) -> int: ...

    def adopt(self, slot: str, conversations: Iterable[str]) -> None: ...


class CacheFailed(Exception):
    """A save or restore the server refused or answered with something unusable."""


@dataclass
class CacheStatus:
    """What /api/slots shows of a slot's saved caches."""

    saved_at: float | None = None  # epoch seconds of the last save
    saved_tokens: int = 0
    save_ms: float | None = None
    restored_at: float | None = None
    restored_tokens: int = 0
    restore_ms: float | None = None
    failures: int = 0  # saves and restores that failed since hal0d started

    def view(self) -> dict[str, Any]:
        return {"saved_at": self.saved_at, "saved_tokens": self.saved_tokens,
                "save_ms": self.save_ms, "restored_at": self.restored_at,
                "restored_tokens": self.restored_tokens, "restore_ms": self.restore_ms,
                "failures": self.failures}


def _ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000.0, 1)


class PromptCache:
    """The saved caches of one slot's command, in its folder."""

    def __init__(self, slot: str, folder: Path) -> None:
        self.slot = slot
        self.folder = folder
        self.status = CacheStatus()
        # Whether the save under way asked the server to write a file: from then on the files
        # the manifest names may be half written, and a failure drops it.
        self.writing = False
        # The command's key (cache_dir.command_digest: its weights' identity too) as it was
        # when the running process was launched: a model file replaced while hal0d runs keeps
        # the folder until the next reload, and the key tells the files of the old weights.
        self.launched_key: str | None = None

    def launching(self, command: Sequence[str]) -> None:
        """A process of `command` is about to read its weights: what its caches will be of."""
        self.launched_key = command_digest(command)

    # -- save --------------------------------------------------------------------------------

    async def save(self, client: UpstreamClient, config: SlotConfig,
                   conversations: list[str]) -> bool:
        """Each server slot that holds a prompt saved, within save_timeout_s; True when all
        were (the manifest then names them and `conversations`)."""
        started = time.monotonic()
        self.writing = False
        try:
            async with asyncio.timeout(config.save_timeout_s):
                files = await self._save_slots(client, config)
        except TimeoutError:
            cause = f"not saved within save_timeout_s = {config.save_timeout_s:g} s"
        except (UpstreamUnavailable, CacheFailed) as exc:
            cause = getattr(exc, "cause", None) or str(exc)
        else:
            tokens = sum(entry["tokens"] for entry in files)
            self._write_manifest({"saved_at": time.time(), "files": files,
                                  "conversations": conversations if tokens else [],
                                  "weights": self.launched_key})
            self.prune(config.prompt_cache_max_mib)
            status = self.status
            status.saved_at, status.saved_tokens, status.save_ms = (
                time.time(), tokens, _ms(started))
            log.info("slot.cache_saved", slot=self.slot, files=len(files), tokens=tokens,
                     bytes=sum(entry["bytes"] for entry in files), ms=status.save_ms)
            return True
        self._failed("slot.cache_save_failed", cause, started, drop=self.writing)
        return False

    async def _save_slots(self, client: UpstreamClient, config: SlotConfig
                          ) -> list[dict[str, Any]]:
        listed = await self._ask(client, config, hdrs.METH_GET, "/slots", None)
        if not isinstance(listed, list):
            raise CacheFailed("GET /slots did not answer a list of slots")
        # A slot restored and not used since shows no prompt (llama-server lists a slot's
        # tokens only with a task): the file it was restored from is still what it holds.
        before = {entry.get("id"): entry for entry in self._read_manifest().get("files", [])
                  if (self.folder / str(entry.get("file"))).is_file()}
        files = []
        for entry in listed:
            if not isinstance(entry, dict) or not isinstance(entry.get("id"), int):
                continue
            if not entry.get("n_prompt_tokens"):
                if entry["id"] in before:
                    files.append(before[entry["id"]])
                continue  # else it never held a prompt: nothing to keep
            name = f"slot{entry['id']}.bin"
            path = f"/slots/{entry['id']}?action=save"
            self.writing = True
            saved = await self._ask(client, config, hdrs.METH_POST, path, {"filename": name})
            files.append({"id": entry["id"], "file": name,
                          "tokens": count_in(saved, "n_saved", path),
                          "bytes": count_in(saved, "n_written", path)})
        return files

    # -- restore -----------------------------------------------------------------------------

    async def restore(self, client: UpstreamClient, config: SlotConfig) -> list[str]:
        """The files the last save names, read back into their server slots within
        save_timeout_s; returns the conversations they hold (none when nothing was restored)."""
        manifest = self._read_manifest()
        files = [entry for entry in manifest.get("files", [])
                 if entry.get("tokens") and (self.folder / str(entry.get("file"))).is_file()]
        if not files:
            return []
        if manifest.get("weights") != self.launched_key:
            self._drop_manifest()
            log.warning("slot.cache_not_restored", slot=self.slot, manifest="dropped",
                        reason="the model files or LLAMA_* variables changed since the save")
            return []
        started = time.monotonic()
        try:
            async with asyncio.timeout(config.save_timeout_s):
                restored = 0
                for entry in files:
                    path = f"/slots/{entry['id']}?action=restore"
                    answer = await self._ask(client, config, hdrs.METH_POST, path,
                                             {"filename": entry["file"]})
                    restored += count_in(answer, "n_restored", path)
        except TimeoutError:
            cause = f"not restored within save_timeout_s = {config.save_timeout_s:g} s"
        except (UpstreamUnavailable, CacheFailed) as exc:
            cause = getattr(exc, "cause", None) or str(exc)
        else:
            status = self.status
            status.restored_at, status.restored_tokens, status.restore_ms = (
                time.time(), restored, _ms(started))
            log.info("slot.cache_restored", slot=self.slot, files=len(files), tokens=restored,
                     ms=status.restore_ms, saved_at=manifest.get("saved_at"))
            held = manifest.get("conversations") or []
            return [key for key in held if isinstance(key, str)]
        self._failed("slot.cache_restore_failed", cause, started)
        return []

    # -- the server's answers, the manifest, the folder ---------------------------------------

    async def _ask(self, client: UpstreamClient, config: SlotConfig, method: str, path: str,
                   body: dict[str, Any] | None) -> Any:
        status, data = await client.ask(
            config, method, path, during=f"waiting for {method} {path}",
            timeout_s=config.save_timeout_s,
            body=orjson.dumps(body) if body is not None else None)
        try:
            answer = orjson.loads(data) if data else None
        except orjson.JSONDecodeError:
            answer = None
        if status != 200 or answer is None:
            message = upstream_message(answer) or data[:200].decode("utf-8", "replace")
            raise CacheFailed(f"{method} {path} answered {status}: {message}")
        return answer

    def _failed(self, event: str, cause: str, started: float, drop: bool = True) -> None:
        self.status.failures += 1
        if drop:
            self._drop_manifest()  # what a failed save left is never restored
        log.warning(event, slot=self.slot, reason=cause, ms=_ms(started),
                    manifest="dropped" if drop else "kept")

    def _read_manifest(self) -> dict[str, Any]:
        try:
            manifest = orjson.loads((self.folder / MANIFEST).read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return {}
        if not isinstance(manifest, dict):
            return {}
        # Read back as data too: an entry that is no object is none of ours.
        files = manifest.get("files")
        manifest["files"] = [e for e in files if isinstance(e, dict)] if isinstance(
            files, list) else []
        return manifest

    def _write_manifest(self, manifest: dict[str, Any]) -> None:
        path = self.folder / MANIFEST
        partial = path.with_suffix(".partial")
        try:
            partial.write_bytes(orjson.dumps(manifest))
            os.replace(partial, path)  # whole or not at all
        except OSError as exc:
            log.warning("slot.cache_manifest_failed", slot=self.slot, error=str(exc))

    def _drop_manifest(self) -> None:
        with contextlib.suppress(OSError):
            (self.folder / MANIFEST).unlink()

    def prune(self, max_mib: int) -> list[str]:
        """The folder within `max_mib`: its oldest files deleted first (and dropped from the
        manifest); returns their names."""
        sizes = self._file_sizes()
        total = sum(size for _, _, size in sizes)
        deleted = []
        for _, oldest, size in sizes:
            if total <= max_mib * MIB:
                break
            total -= size
            with contextlib.suppress(OSError):
                oldest.unlink()
            deleted.append(oldest.name)
        if deleted:
            manifest = self._read_manifest()
            manifest["files"] = [entry for entry in manifest.get("files", [])
                                 if entry.get("file") not in deleted]
            self._write_manifest(manifest)
            log.info("slot.cache_pruned", slot=self.slot, deleted=deleted,
                     prompt_cache_max_mib=max_mib)
        return deleted

    def _file_sizes(self) -> list[tuple[int, Path, int]]:
        """(mtime_ns, path, size) of the folder's files but the manifest, oldest first; a file
        removed meanwhile (by the server, by hand) is simply not there."""
        found = []
        try:
            paths = list(self.folder.iterdir())
        except OSError:
            return []
        for path in paths:
            try:
                info = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode) and path.name != MANIFEST:
                found.append((info.st_mtime_ns, path, info.st_size))
        return sorted(found, key=lambda entry: entry[0])


def count_in(answer: Any, key: str, path: str) -> int:
    """The count `key` of a save or restore answer: what a model server says about itself is
    data to check, so an answer that is no object, or a count that is no whole number, is a
    failed save or restore (CacheFailed), never a crash of the load or unload that asked."""
    if not isinstance(answer, dict):
        raise CacheFailed(f"POST {path} answered {type(answer).__name__}, not an object")
    count = answer.get(key, 0)
    if count is None:
        return 0
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise CacheFailed(f"POST {path} answered {key} = {count!r}, not a count")
    return count


def make_folder(folder: str) -> None:
    """A `{prompt_cache_dir}` exists before the process it is named to is launched (llama-server
    refuses to start with a --slot-save-path that is no folder), whether hal0d saves into it
    or not. The root may be anything the operator chose (a symlink too); the slot's folder and
    the command's folder in it are created here and must be real folders: a symlink or a file
    there fails the launch (LaunchFailed), logged."""
    command_dir = Path(folder)
    slot_dir = command_dir.parent
    slot_dir.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    for path in (slot_dir, command_dir):
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)  # mkdir never follows a symlink at `path`
        kind = _kind(path)
        if kind != "folder":
            log.error("prompt_cache.folder_refused", folder=str(path), found=kind)
            raise LaunchFailed(f"the prompt cache folder {path} is a {kind}, not a folder "
                               "hal0d made: it is not followed; remove it")


def _kind(path: Path) -> str:
    """What is at `path`, the link itself when it is one: folder, symlink or other."""
    try:
        mode = path.lstat().st_mode
    except OSError:
        return "missing path"
    if stat.S_ISLNK(mode):
        return "symlink"
    return "folder" if stat.S_ISDIR(mode) else "file"


def sweep(root: Path, configs: Iterable[SlotConfig]) -> list[str]:
    """The folders under `root` that none of `configs` names any more (a removed slot's, a
    changed command's), deleted; returns them. Only folders named as cache_dir.py names them
    are touched."""
    kept = {Path(c.prompt_cache_dir) for c in configs if c.prompt_cache_dir is not None}
    deleted: list[str] = []
    if not root.is_dir():
        return deleted
    for slot_dir in _folders(root):
        for folder in _folders(slot_dir):
            if folder in kept or not _is_digest(folder.name):
                continue
            shutil.rmtree(folder, ignore_errors=True)
            deleted.append(str(folder))
        with contextlib.suppress(OSError):
            slot_dir.rmdir()  # only when empty
    if deleted:
        log.info("prompt_cache.swept", folders=deleted)
    return deleted


def _folders(parent: Path) -> list[Path]:
    """The real folders in `parent`; a symlink to one is logged and never followed."""
    try:
        paths = list(parent.iterdir())
    except OSError:
        return []
    found = []
    for path in paths:
        kind = _kind(path)
        if kind == "symlink":
            log.warning("prompt_cache.symlink_skipped", path=str(path),
                        reason="the sweep follows no symlink")
        elif kind == "folder":
            found.append(path)
    return found


def _is_digest(name: str) -> bool:
    return len(name) == DIGEST_LENGTH and all(ch in "0123456789abcdef" for ch in name)
