"""The prompt-cache folder is keyed by what its caches mean and trusts none of its paths: a model
file replaced at the same `-m` path is other weights (its caches are never restored into them,
the old folder is swept), `LLAMA_*` variables are part of the key, a symlink where a slot's
folder should be is never followed (neither to create the folder nor by the sweep), a slot name
cannot leave the root, a file gone during a prune is no error, and a save that failed before
it touched a file keeps the last good manifest. Against a real `hal0d serve` and the stub, or a
purpose-built aiohttp upstream, over real sockets."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web

from hal0d.config import ConfigError, DispatcherConfig, SlotConfig, parse
from hal0d.config.cache_dir import cache_root, command_digest
from hal0d.lifecycle.prompt_cache import MANIFEST, PromptCache, make_folder
from hal0d.transport.upstream import UpstreamClient
from tests.harness.daemons import Hal0dProcessFactory, stop
from tests.harness.prompt_cache import (
    cached,
    command,
    folders,
    slot,
    turn,
    unload,
    warm,
)
from tests.harness.stubs import Upstream

DIGEST = "0123456789abcdef"


def model_slot(tmp_path: Path, model: Path) -> str:
    return slot("a", "chat", tmp_path, "-m", str(model))


def replace_model(model: Path) -> None:
    """Other weights at the same path: another size, another modification time."""
    model.write_bytes(b"GGUF other weights, a little longer")
    os.utime(model, ns=(1_000_000_000, 1_000_000_000))


async def test_a_model_file_replaced_while_hal0d_runs_is_not_restored_into(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights")
    hal0d = await start_hal0d_process(slot=model_slot(tmp_path, model))
    await turn(http, hal0d, "chat", 1)
    await unload(http, hal0d, "a")
    assert len(hal0d.named("slot.cache_saved")) == 1
    replace_model(model)
    assert cached(await turn(http, hal0d, "chat", 2)) == 0  # the next load: cold
    assert not hal0d.named("slot.cache_restored")
    [refused] = hal0d.named("slot.cache_not_restored")
    assert refused["slot"] == "a" and "model files" in refused["reason"], refused


async def one_turn_then_stopped(start_hal0d_process: Hal0dProcessFactory, tmp_path: Path,
                                http: aiohttp.ClientSession) -> tuple[Path, str]:
    """A hal0d whose slot names a model file served one turn and stopped (its cache saved at
    shutdown): the model file and the slot's config, for the hal0d that comes next."""
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF weights")
    config = model_slot(tmp_path, model)
    hal0d = await start_hal0d_process(slot=config)
    await turn(http, hal0d, "chat", 1)
    await stop(hal0d.process)
    return model, config


async def test_a_model_file_replaced_across_a_restart_gets_a_new_folder_the_old_one_swept(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    model, config = await one_turn_then_stopped(start_hal0d_process, tmp_path, http)
    [old] = folders(tmp_path, "a")
    replace_model(model)
    again = await start_hal0d_process(slot=config)
    assert cached(await turn(http, again, "chat", 2)) == 0
    assert not again.named("slot.cache_restored")
    [new] = folders(tmp_path, "a")  # the old weights' folder deleted, not reused
    assert new != old and new == command_digest(command("a", tmp_path, "-m", str(model)))


async def test_the_same_model_file_across_a_restart_is_still_restored(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    _, config = await one_turn_then_stopped(start_hal0d_process, tmp_path, http)
    again = await start_hal0d_process(slot=config)
    assert warm(await turn(http, again, "chat", 2))
    assert again.named("slot.cache_restored")


def test_llama_variables_are_part_of_the_folders_key_and_nothing_else_of_the_environment(
        tmp_path: Path) -> None:
    argv = ["llama-server", "-hf", "Qwen/Qwen3-8B-GGUF", "--slot-save-path", "{prompt_cache_dir}"]
    plain = command_digest(argv, {"PATH": "/usr/bin"})
    assert command_digest(argv, {"PATH": "/bin", "INVOCATION_ID": "x"}) == plain
    assert command_digest(argv, {"LLAMA_ARG_CTX_SIZE": "8192"}) != plain
    assert command_digest(argv, {"LLAMA_CACHE": str(tmp_path)}) != plain


# -- the folder's paths --------------------------------------------------------------------


async def test_a_symlink_at_the_slots_folder_is_not_followed_and_the_load_says_why(
    start_hal0d_process: Hal0dProcessFactory, tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    root = cache_root(tmp_path / "history.sqlite3")
    elsewhere, other = tmp_path / "elsewhere", tmp_path / "someone-elses"
    for target in (elsewhere, other):
        (target / DIGEST).mkdir(parents=True)
        (target / DIGEST / "keep.bin").write_bytes(b"not hal0d's")
    root.mkdir()
    (root / "a").symlink_to(elsewhere)  # where slot a's folder would be
    (root / "gone").symlink_to(other)  # no slot's: the sweep's to look at
    hal0d = await start_hal0d_process(slot=slot("a", "chat", tmp_path))
    async with http.post(f"{hal0d.url}/v1/chat/completions", json={
            "model": "chat", "messages": [{"role": "user", "content": "hi"}]}) as resp:
        assert resp.status >= 500, await resp.text()
    refused = hal0d.named("prompt_cache.folder_refused")[0]
    assert refused["folder"] == str(root / "a") and refused["found"] == "symlink", refused
    assert sorted(p.name for p in elsewhere.iterdir()) == [DIGEST]  # nothing made there
    assert (other / DIGEST / "keep.bin").exists() and (elsewhere / DIGEST / "keep.bin").exists()
    skipped = {event["path"] for event in hal0d.named("prompt_cache.symlink_skipped")}
    assert str(root / "gone") in skipped, hal0d.log.read_text()[-2000:]


@pytest.mark.parametrize("name", ["../up", "a/b", ".hidden", "..", "sp ace", "é"])
def test_a_slot_name_that_is_no_plain_folder_name_is_refused(name: str) -> None:
    with pytest.raises(ConfigError, match=r"slots\[0\]\.name: .* must be letters, digits"):
        parse({"slots": [{"name": name, "upstream": "http://127.0.0.1:1", "models": ["m"]}]})


def test_a_slot_name_of_the_safe_characters_is_taken() -> None:
    config = parse({"slots": [{"name": "Qwen3-8B_q4.k", "upstream": "http://127.0.0.1:1",
                               "models": ["m"]}]})
    assert config.slots[0].name == "Qwen3-8B_q4.k"


# -- prune and a failed save ---------------------------------------------------------------


@pytest.mark.parametrize("after_calls", [1, 2, 3])
def test_a_file_removed_during_a_prune_is_no_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_calls: int) -> None:
    """The server (or an operator) removes a file while the prune looks at the folder: after
    the first, second or third time the file was looked at, it is gone."""
    cache = PromptCache("a", tmp_path / "a" / DIGEST)
    make_folder(str(cache.folder))
    for n in range(3):
        (cache.folder / f"slot{n}.bin").write_bytes(b"x" * 600 * 1024)
    vanishing = str(cache.folder / "slot0.bin")
    real_stat = os.stat
    calls = 0

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        nonlocal calls
        answer = real_stat(path, *args, **kwargs)
        if str(path) == vanishing:
            calls += 1
            if calls == after_calls:
                os.unlink(vanishing)
        return answer

    monkeypatch.setattr(os, "stat", stat)
    cache.prune(1)
    monkeypatch.undo()
    assert sum(p.stat().st_size for p in cache.folder.iterdir()) <= 1024 * 1024


def slots_upstream(listing: Callable[[web.Request], Any], save_status: int
                   ) -> dict[str, Callable[[web.Request], Any]]:
    async def slots(request: web.Request) -> web.Response:
        return await listing(request)

    async def save(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "disk full"}}, status=save_status)

    return {"GET /slots": slots, "POST /slots/{id}": save}


async def saved_folder(tmp_path: Path) -> PromptCache:
    """A folder with a good save in it: a manifest and the file it names."""
    cache = PromptCache("a", tmp_path / "a" / DIGEST)
    make_folder(str(cache.folder))
    (cache.folder / "slot0.bin").write_bytes(b"state")
    (cache.folder / MANIFEST).write_bytes(orjson.dumps({"saved_at": 1.0, "files": [
        {"id": 0, "file": "slot0.bin", "tokens": 100, "bytes": 5}], "conversations": []}))
    return cache


async def save_against(upstream_app: Upstream, cache: PromptCache,
                       routes: dict[str, Callable[[web.Request], Any]]) -> bool:
    url = await upstream_app(routes)
    config = SlotConfig(name="a", upstream=url, models=("m",), save_timeout_s=2.0)
    client = UpstreamClient.create(DispatcherConfig())
    try:
        return await cache.save(client, config, [])
    finally:
        await client.close()


async def test_a_save_that_failed_before_touching_a_file_keeps_the_last_good_manifest(
        upstream_app: Upstream, tmp_path: Path) -> None:
    async def refused(_: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "busy"}}, status=503)

    cache = await saved_folder(tmp_path)
    assert not await save_against(upstream_app, cache, slots_upstream(refused, 500))
    assert (cache.folder / MANIFEST).exists()  # the last save is still whole: kept


async def test_a_save_that_failed_while_writing_drops_the_manifest(
        upstream_app: Upstream, tmp_path: Path) -> None:
    async def listed(_: web.Request) -> web.Response:
        return web.json_response([{"id": 0, "n_prompt_tokens": 120}])

    cache = await saved_folder(tmp_path)
    assert not await save_against(upstream_app, cache, slots_upstream(listed, 500))
    assert not (cache.folder / MANIFEST).exists()  # its file may be half written
