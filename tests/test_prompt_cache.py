"""Prompt caches kept across a stop, against a real `hal0d serve` and the stub taught
llama-server's prompt cache (`--parallel`, `--slot-save-path`, GET /slots, POST
/slots/{id}?action=save|restore, `usage.prompt_tokens_details.cached_tokens`): saved before an
idle unload, an eviction for a swap and a shutdown; restored after the next load before its
first request; never into a changed command; a removed slot's files deleted; a folder bound;
and a save that fails or hangs neither fails nor holds the unload past save_timeout_s."""

from __future__ import annotations

import os
import time
from pathlib import Path

import aiohttp
import orjson
import pytest

from hal0d.config import ConfigError, parse
from hal0d.config.cache_dir import command_digest
from hal0d.lifecycle.prompt_cache import MANIFEST, PromptCache, make_folder, sweep
from tests.harness.client import state_is, views
from tests.harness.daemons import Hal0dProcessFactory, reload, stop
from tests.harness.poll import eventually
from tests.harness.prompt_cache import (
    cached,
    command,
    folders,
    slot,
    turn,
    unload,
    warm,
)

STARTUP_S = 15.0


# -- saved and restored ----------------------------------------------------------------------


async def test_an_idle_unload_saves_the_cache_and_the_next_load_restores_it_first(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path, idle_unload_s=1.0))
    first = await turn(http, hal0d, "chat", 1)
    assert cached(first) == 0
    assert warm(await turn(http, hal0d, "chat", 2))  # the same process: its own cache
    view = await state_is(http, hal0d, "a", "stopped")  # unloaded when idle
    saved = hal0d.named("slot.cache_saved")
    assert len(saved) == 1 and saved[0]["slot"] == "a" and saved[0]["tokens"] > 0, saved
    assert view["prompt_cache"]["saved_at"] is not None
    assert view["conversations_warm"] == 1  # kept: its cache is on disk
    assert folders(tmp_path, "a") == [command_digest(command("a", tmp_path))]
    again = await turn(http, hal0d, "chat", 3)
    assert warm(again), again
    [restored] = hal0d.named("slot.cache_restored")
    assert restored["tokens"] == saved[0]["tokens"]
    # Restored before the first request was admitted: before the load was done (the slot is
    # told `answered`, and grants its first lease, after slot.loaded).
    events = [e["event"] for e in hal0d.events()]
    loaded = len(events) - 1 - events[::-1].index("slot.loaded")
    assert events.index("slot.cache_restored") < loaded
    view = (await views(http, hal0d))["a"]
    assert view["prompt_cache"]["restored_at"] is not None
    assert view["prompt_cache"]["restored_tokens"] == restored["tokens"]


async def test_a_cache_restored_and_unloaded_again_unused_is_still_there_next_time(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """llama-server lists a restored slot as empty until it runs a task: its save must keep the
    file the slot was restored from, not drop it as a slot with nothing to save."""
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path))
    await turn(http, hal0d, "chat", 1)
    await unload(http, hal0d, "a")
    async with http.post(f"{hal0d.url}/api/slots/a/load") as resp:  # an operator's load
        assert resp.status == 200, await resp.text()
    assert len(hal0d.named("slot.cache_restored")) == 1
    await unload(http, hal0d, "a")  # no turn in between
    assert len(hal0d.named("slot.cache_saved")) == 2
    assert warm(await turn(http, hal0d, "chat", 2))


async def test_without_a_saved_cache_an_unload_leaves_the_conversation_cold(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path, prompt_cache="off"))
    await turn(http, hal0d, "chat", 1)
    assert (await views(http, hal0d))["a"]["conversations_warm"] == 1
    await unload(http, hal0d, "a")
    view = await state_is(http, hal0d, "a", "stopped")
    assert view["conversations_warm"] == 0  # forgotten: the process took its cache along
    assert view["prompt_cache"] is None and not hal0d.named("slot.cache_saved")
    assert cached(await turn(http, hal0d, "chat", 2)) == 0


async def test_a_swap_saves_the_evicted_models_cache_and_restores_it_on_its_way_back(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    group = '[groups.gpu]\nmax_loaded = 1\npolicy = "fifo"\n'
    hal0d = await start_hal0d_process(slot=group + slot("a", "chat", tmp_path, group="gpu")
                        + slot("b", "tool", tmp_path, group="gpu"))
    assert cached(await turn(http, hal0d, "chat", 1)) == 0
    await turn(http, hal0d, "tool", 1)  # evicts a: its cache is saved
    assert [e["slot"] for e in hal0d.named("slot.cache_saved")] == ["a"]
    assert warm(await turn(http, hal0d, "chat", 2))  # evicts b, restores a
    assert [e["slot"] for e in hal0d.named("slot.cache_saved")] == ["a", "b"]
    assert warm(await turn(http, hal0d, "tool", 2))


async def test_a_restart_of_hal0d_keeps_the_conversation_warm(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    config = slot("a", "chat", tmp_path)
    hal0d = await start_hal0d_process(slot=config)
    await turn(http, hal0d, "chat", 1)
    await stop(hal0d.process)  # SIGTERM, as systemd stops it
    assert [e["slot"] for e in hal0d.named("slot.cache_saved")] == ["a"]
    again = await start_hal0d_process(slot=config)
    assert warm(await turn(http, again, "chat", 2))
    assert again.named("slot.cache_restored")


# -- what is never restored, and the folder --------------------------------------------------


async def test_a_changed_command_restores_nothing_and_its_old_files_are_deleted(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path))
    await turn(http, hal0d, "chat", 1)
    await unload(http, hal0d, "a")
    old = command_digest(command("a", tmp_path))
    assert folders(tmp_path, "a") == [old]
    changed = slot("a", "chat", tmp_path, "--ctx-size", "8192")  # another context: other caches
    await reload(hal0d, changed)
    new = command_digest(command("a", tmp_path, "--ctx-size", "8192"))
    assert cached(await turn(http, hal0d, "chat", 2)) == 0
    assert not hal0d.named("slot.cache_restored")
    assert folders(tmp_path, "a") == [new]  # the old command's files are gone
    await reload(hal0d, slot("b", "tool", tmp_path))  # a removed: its folder goes too
    await eventually(lambda: folders(tmp_path, "a") == [] or None, STARTUP_S,
                     "the removed slot's caches deleted")


def test_the_folder_is_kept_within_its_bound_oldest_files_first(tmp_path: Path) -> None:
    cache = PromptCache("a", tmp_path / "a" / ("0" * 16))
    make_folder(str(cache.folder))
    for n, age in enumerate((30, 20, 10)):
        path = cache.folder / f"slot{n}.bin"
        path.write_bytes(b"x" * 600 * 1024)
        os.utime(path, (time.time() - age, time.time() - age))
    (cache.folder / MANIFEST).write_bytes(orjson.dumps({"files": [
        {"id": n, "file": f"slot{n}.bin", "tokens": 10, "bytes": 600 * 1024}
        for n in range(3)]}))
    assert cache.prune(1) == ["slot0.bin", "slot1.bin"]  # 1.8 MiB down to 0.6 MiB
    assert sorted(p.name for p in cache.folder.iterdir()) == [MANIFEST, "slot2.bin"]
    manifest = orjson.loads((cache.folder / MANIFEST).read_bytes())
    assert [entry["file"] for entry in manifest["files"]] == ["slot2.bin"]
    assert cache.prune(1) == []


def test_the_sweep_deletes_only_caches_no_command_names(tmp_path: Path) -> None:
    keep = parse({"slots": [{"name": "a", "upstream": "http://127.0.0.1:1", "models": ["m"],
                             "command": ["srv", "--slot-save-path", "{prompt_cache_dir}"],
                             "prompt_cache": "save"}],
                  "metrics": {"database": str(tmp_path / "history.sqlite3")}}, tmp_path)
    kept = Path(keep.slots[0].prompt_cache_dir or "")
    assert kept.parent.parent == tmp_path / "prompt-cache"
    stale = [kept.parent / ("f" * 16), tmp_path / "prompt-cache" / "gone" / ("1" * 16)]
    mine = tmp_path / "prompt-cache" / "a" / "notes"  # not a folder hal0d names: left alone
    for folder in (kept, *stale, mine):
        folder.mkdir(parents=True)
        (folder / "slot0.bin").write_bytes(b"x")
    assert sorted(sweep(tmp_path / "prompt-cache", keep.slots)) == sorted(map(str, stale))
    assert kept.is_dir() and mine.is_dir()
    assert not (tmp_path / "prompt-cache" / "gone").exists()


def test_save_needs_the_folder_in_the_command() -> None:
    with pytest.raises(ConfigError, match=r"needs \{prompt_cache_dir\} in the command"):
        parse({"slots": [{"name": "a", "upstream": "http://127.0.0.1:1", "models": ["m"],
                          "command": ["srv"], "prompt_cache": "save"}]})
    with pytest.raises(ConfigError, match="only for a slot with a command"):
        parse({"slots": [{"name": "a", "upstream": "http://127.0.0.1:1", "models": ["m"],
                          "prompt_cache": "save"}]})


# -- failures never hold a request or an unload ----------------------------------------------


async def test_a_hanging_save_does_not_hold_the_unload_past_its_bound(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path, "--slot-save-delay", "30",
                             save_timeout_s=0.5))
    await turn(http, hal0d, "chat", 1)
    took = await unload(http, hal0d, "a")
    assert took < 0.5 + 3.0, took  # the bound, then the stop (SIGTERM: the stub ends at once)
    [failed] = hal0d.named("slot.cache_save_failed")
    assert "save_timeout_s = 0.5" in failed["reason"]
    view = (await views(http, hal0d))["a"]
    assert view["prompt_cache"]["failures"] == 1 and view["conversations_warm"] == 0
    assert cached(await turn(http, hal0d, "chat", 2)) == 0  # cold, but answered
    assert not hal0d.named("slot.cache_restored")


async def test_a_refused_save_or_restore_is_logged_and_the_load_goes_on_cold(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path, "--slot-save-fail")
                        + slot("b", "tool", tmp_path, "--slot-restore-fail"))
    for model, name in (("chat", "a"), ("tool", "b")):
        await turn(http, hal0d, model, 1)
        await unload(http, hal0d, name)
    [save_failed] = hal0d.named("slot.cache_save_failed")
    assert save_failed["slot"] == "a" and "500" in save_failed["reason"]
    assert [e["slot"] for e in hal0d.named("slot.cache_saved")] == ["b"]
    for model in ("chat", "tool"):
        assert cached(await turn(http, hal0d, model, 2)) == 0
    [restore_failed] = hal0d.named("slot.cache_restore_failed")
    assert restore_failed["slot"] == "b"
