"""End to end on a real model server: SmolLM2-135M found by two `[[library]]` tables, an Ollama
store (as `ollama pull` leaves it: a manifest for `smollm2:135m` naming its blob by the file's
sha256) and a folder of GGUF files, both holding the one file (links to it), and served by the
library's default command: llama-server found on PATH, with no `command` written anywhere.

What it proves, with the openai and ollama clients against one real `hal0d serve`:
- the file found twice is ONE slot under both names, the Ollama store's first (its table is
  listed first), so `smollm2:135m` is its main name: GET /api/library shows one model with both
  names, GET /api/slots one slot with both, and nothing else;
- on demand: the slot is stopped before any request, and the first request loads it (launched
  from the default command: the llama-server on PATH, `--alias smollm2:135m`, `-c 8192`, the
  model's trained context, which the library's default context does not cut);
- the answer's `model` is the asked name, `smollm2:135m`, whole and streamed through /v1 and
  through the ollama client. It is so because llama-server answers under its `--alias`, which
  hal0d sets to the model's MAIN name; asked by the folder's name, the answer still carries the
  main name (llama-server's, relayed as it came);
- the Ollama listener lists it as Ollama does a pulled model: format gguf, family llama,
  quantization Q4_1, the file's size, and /api/show's `llama.context_length` is 8192, read from
  the GGUF header;
- `idle_unload_s` comes from the table that found the model (the store's, 15 s; the folder's
  table says nothing, so it would have been the library default of 300): /api/slots and the
  ollama client's `ps` show the unload due within it, and the slot is stopped once it passed.

Run by `make test-real` (HAL0D_REAL_SERVER, HAL0D_REAL_MODEL); about 30 s, most of it the idle
wait.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import openai
import pytest
from realserver import (
    REAL_MODEL,
    REAL_SERVER,
    free_port,
    get_json,
    require_real_server,
    running_hal0d,
    slots,
)

from hal0d.library.gguf_facts import read_facts

OLLAMA_NAME = "smollm2:135m"
FOLDER_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the link's path below the folder, without .gguf
SLOT = "smollm2-135m"  # the main name made a slot name
IDLE_UNLOAD_S = 15
OLLAMA_PORT = free_port()
OLLAMA = f"http://127.0.0.1:{OLLAMA_PORT}"
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def ollama_store(root: Path, name: str, model: str) -> Path:
    """An Ollama store at `root` holding `model` as `name` (`model:tag`, in Ollama's own
    library), written as `ollama pull` leaves it: the weights a blob named by their sha256 (here
    a link to the file), a config blob, and the manifest naming both."""
    blobs = root / "blobs"
    blobs.mkdir(parents=True)
    hexdigest = sha256_of(model)
    (blobs / f"sha256-{hexdigest}").symlink_to(model)
    config = json.dumps({"model_format": "gguf", "model_family": "llama",
                         "file_type": "Q4_1", "os": "linux"}).encode()
    config_hex = hashlib.sha256(config).hexdigest()
    (blobs / f"sha256-{config_hex}").write_bytes(config)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json",
                   "digest": f"sha256:{config_hex}", "size": len(config)},
        "layers": [{"mediaType": "application/vnd.ollama.image.model",
                    "digest": f"sha256:{hexdigest}", "size": os.path.getsize(model)}],
    }
    model_name, tag = name.split(":")
    path = root / "manifests" / "registry.ollama.ai" / "library" / model_name / tag
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(manifest, separators=(",", ":")) + "\n")
    return root


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("library")


@pytest.fixture(scope="module")
def hal0d(folder: Path) -> Iterator[str]:
    require_real_server()
    store = ollama_store(folder / "ollama", OLLAMA_NAME, REAL_MODEL)
    models = folder / "models"
    models.mkdir()
    (models / f"{FOLDER_NAME}.gguf").symlink_to(REAL_MODEL)
    config: dict[str, Any] = {
        "ollama": {"listen": f"127.0.0.1:{OLLAMA_PORT}"},
        # The store first: the model is its (its names first, its idle_unload_s).
        "library": [{"path": str(store), "idle_unload_s": IDLE_UNLOAD_S},
                    {"path": str(models)}],
    }
    # No `command`: the default one runs `llama-server`, found on PATH (nothing of that name
    # is beside hal0d's Python). hal0d inherits this process's environment.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PATH", os.path.dirname(REAL_SERVER), prepend=os.pathsep)
        with running_hal0d(folder, config,
                           lambda views: views.get(SLOT, {}).get("state") == "stopped") as base:
            yield base


def openai_client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)


def test_the_file_found_twice_is_one_slot_under_both_names_and_not_loaded(hal0d: str) -> None:
    library = get_json(f"{hal0d}/api/library")
    assert library["problems"] == []
    [model] = library["models"]
    assert model["names"] == [OLLAMA_NAME, FOLDER_NAME]
    assert model["slot"] == SLOT and model["source"].startswith("ollama ")
    assert os.path.realpath(model["file"]) == os.path.realpath(REAL_MODEL)
    assert (model["family"], model["quantization"]) == ("llama", "Q4_1")
    assert model["trained_context"] == model["context"] == 8192
    assert model["state"] == "stopped"
    views = slots(hal0d)
    assert list(views) == [SLOT]
    view = views[SLOT]
    assert view["models"] == [OLLAMA_NAME, FOLDER_NAME]
    # On demand: nothing runs before a request asks for it.
    assert (view["state"], view["start"], view["pid"]) == ("stopped", "on_demand", None)


def test_the_openai_sdk_is_answered_under_the_ollama_name_whole_and_streamed(
        hal0d: str) -> None:
    client = openai_client(hal0d)
    answer = client.chat.completions.create(model=OLLAMA_NAME, max_tokens=16, messages=MESSAGES)
    assert answer.choices[0].message.content
    assert answer.model == OLLAMA_NAME
    stream = client.chat.completions.create(model=OLLAMA_NAME, max_tokens=16, stream=True,
                                            messages=MESSAGES)
    text, models = "", set[str]()
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text.strip()
    assert models == {OLLAMA_NAME}
    view = slots(hal0d)[SLOT]
    assert view["state"] == "ready" and view["pid"] is not None
    # The default command ran: the llama-server on PATH, under the main name, at the model's
    # trained context.
    command = Path(f"/proc/{view['pid']}/cmdline").read_bytes().split(b"\0")[:-1]
    argv = [arg.decode() for arg in command]
    assert os.path.realpath(argv[0]) == os.path.realpath(REAL_SERVER)
    assert argv[argv.index("--alias") + 1] == OLLAMA_NAME
    assert argv[argv.index("-c") + 1] == "8192"
    assert "--mmproj" not in argv and "--jinja" in argv


def test_asked_by_the_folders_name_the_answer_carries_the_main_name(hal0d: str) -> None:
    answer = openai_client(hal0d).chat.completions.create(model=FOLDER_NAME, max_tokens=8,
                                                          messages=MESSAGES)
    assert answer.choices[0].message.content
    assert answer.model == OLLAMA_NAME  # llama-server's --alias, relayed as it came


def test_the_ollama_client_lists_shows_and_chats_under_the_ollama_name(hal0d: str) -> None:
    import ollama

    client = ollama.Client(host=OLLAMA)
    listed = {model.model: model for model in client.list().models}
    assert set(listed) == {OLLAMA_NAME, FOLDER_NAME}
    tagged = listed[OLLAMA_NAME]
    assert tagged.details is not None
    assert (tagged.details.format, tagged.details.family,
            tagged.details.quantization_level) == ("gguf", "llama", "Q4_1")
    assert tagged.size == os.path.getsize(REAL_MODEL) > 0
    facts = read_facts(Path(REAL_MODEL))
    assert facts.context_length == 8192
    shown = client.show(OLLAMA_NAME)
    assert shown.modelinfo is not None
    assert shown.modelinfo["llama.context_length"] == facts.context_length
    whole = client.chat(model=OLLAMA_NAME, messages=MESSAGES, options={"num_predict": 16})
    assert whole.model == OLLAMA_NAME
    assert whole.message.content and whole.done_reason in ("stop", "length")
    parts = list(client.chat(model=OLLAMA_NAME, messages=MESSAGES, stream=True,
                             options={"num_predict": 16}))
    assert {part.model for part in parts} == {OLLAMA_NAME}
    assert "".join(part.message.content or "" for part in parts).strip()


def test_the_slot_unloads_after_the_stores_idle_unload_s(hal0d: str) -> None:
    import ollama

    openai_client(hal0d).chat.completions.create(model=OLLAMA_NAME, max_tokens=4,
                                                 messages=MESSAGES)
    used = time.monotonic()
    view = slots(hal0d)[SLOT]
    assert view["state"] == "ready"
    assert 0 < view["idle_unload_in_s"] <= IDLE_UNLOAD_S
    [running] = [model for model in ollama.Client(host=OLLAMA).ps().models
                 if model.model == OLLAMA_NAME]
    assert running.expires_at is not None
    expires_in = (running.expires_at - datetime.now(UTC)).total_seconds()
    assert 0 < expires_in <= IDLE_UNLOAD_S + 1
    deadline = used + IDLE_UNLOAD_S + 20
    while (view := slots(hal0d)[SLOT])["state"] != "stopped":
        assert time.monotonic() < deadline, view
        time.sleep(0.5)
    assert time.monotonic() - used >= IDLE_UNLOAD_S - 1  # the timer's, not sooner
    assert view["pid"] is None
    assert get_json(f"{OLLAMA}/api/ps")["models"] == []
