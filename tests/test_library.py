"""Point hal0d at the models a machine already has: `[[library]]` tables of a folder of GGUF
files, an Ollama store and a Hugging Face cache, each model found served on demand by a slot of
its own, with no slot written by hand. Real GGUF files (tests/harness/gguf_files.py), stores laid
out as their owners write them (tests/harness/model_stores.py), a real `hal0d serve`, the stub
as the model server (it takes llama-server's -m, --mmproj and --alias, and answers under its
alias as llama-server does), real clients.
"""

from __future__ import annotations

import shutil
import signal
import sys
import textwrap
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tests.harness.cli import cli
from tests.harness.daemons import serving
from tests.harness.gguf_files import write_model, write_projector
from tests.harness.model_stores import HfCache, OllamaStore
from tests.harness.ports import free_port

# The stub as every library model's server: the command template a user writes for llama-server.
STUB = [sys.executable, "-m", "hal0d", "stub", "--delay", "0.005", "-m", "{model_path}",
        "--mmproj", "{mmproj}", "--alias", "{alias}", "--port", "{free_port}"]
TOOLS_TEMPLATE = ("{% for m in messages %}{{ m.content }}{% endfor %}"
                  "{% if tools %}{{ tools }}{% endif %}")


def toml_list(items: list[str]) -> str:
    return orjson.dumps(items).decode()


def common(tmp_path: Path, ollama_port: int) -> str:
    return textwrap.dedent(f"""
        [ollama]
        listen = "127.0.0.1:{ollama_port}"

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"

        [logging]
        format = "json"
    """)


async def get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def chat(http: aiohttp.ClientSession, base: str, model: str) -> dict[str, Any]:
    body = {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(f"{base}/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def by_name(library: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {model["names"][0]: model for model in library["models"]}


def models_of(listed: dict[str, Any]) -> set[str]:
    return {entry["id"] for entry in listed["data"]}


def a_folder(root: Path) -> Path:
    """A folder as a homelab keeps one: a model with a tool-calling template, one split in two
    parts, a vision model with its projector beside another quantization of it, a file that is
    no GGUF and one cut short."""
    write_model(root / "tiny-a.gguf", name="tiny a", template=TOOLS_TEMPLATE)
    write_model(root / "big" / "Split.gguf", name="split", layers=4, split=2)
    write_model(root / "vis" / "Vision-Q4_1.gguf", name="vision", context=4096)
    write_model(root / "vis" / "Other-Q4_1.gguf", name="other", template=TOOLS_TEMPLATE)
    write_projector(root / "vis" / "mmproj-Vision-f16.gguf", name="vision")
    (root / "notes.gguf").write_text("these are my notes, not a model\n")
    whole = write_model(root / "cut.gguf", name="cut")[0]
    whole.write_bytes(whole.read_bytes()[:200])
    return root


async def test_a_folder_of_gguf_files_is_served_on_demand_with_what_the_files_say(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    folder = a_folder(tmp_path / "models")
    port, ollama_port = free_port(), free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        # The model "tiny-a" pinned by hand: this slot wins over the folder's.
        [[slots]]
        name = "pinned"
        upstream = "http://127.0.0.1:{{free_port}}"
        models = ["tiny-a"]
        command = {toml_list([*STUB[:4], "--alias", "tiny-a", "--port", "{free_port}"])}

        [[library]]
        path = "{folder}"
        command = {toml_list(STUB)}
        idle_unload_s = 120
        max_concurrent = 2
        context = 1024
    """) + common(tmp_path, ollama_port))
    async with serving(config, port) as hal0d:
        base, ollama = hal0d.url, f"http://127.0.0.1:{ollama_port}"
        assert models_of(await get(http, f"{base}/v1/models")) == {
            "tiny-a", "big/Split", "vis/Vision-Q4_1", "vis/Other-Q4_1"}
        library = await get(http, f"{base}/api/library")
        found = by_name(library)
        assert set(found) == {"big/Split", "vis/Vision-Q4_1", "vis/Other-Q4_1"}
        assert {model["state"] for model in found.values()} == {"stopped"}  # on demand
        problems = "\n".join(library["problems"])
        assert "notes.gguf: not a GGUF file" in problems, problems
        assert "cut.gguf: truncated" in problems, problems

        slots = {view["name"]: view for view in (await get(http, f"{base}/api/slots"))["slots"]}
        split, vision = found["big/Split"], found["vis/Vision-Q4_1"]
        assert split["file"].endswith("big/Split-00001-of-00002.gguf")
        assert split["size_bytes"] == sum(
            path.stat().st_size for path in (folder / "big").iterdir())
        assert vision["mmproj"] == str(folder / "vis" / "mmproj-Vision-f16.gguf")
        # The context: the library's 1024, or the model's own when smaller (none is here).
        assert (vision["context"], vision["trained_context"]) == (1024, 4096)
        assert vision["memory_mib"] == vision["estimate_mib"] > 0
        assert slots["vis-Vision-Q4_1"]["max_concurrent"] == 2

        async with http.post(f"{ollama}/api/show", json={"model": "vis/Vision-Q4_1"}) as resp:
            assert (await resp.json())["capabilities"] == ["completion", "vision"]  # unloaded
        answer = await chat(http, base, "vis/Vision-Q4_1")
        assert answer["model"] == "vis/Vision-Q4_1"  # the server's --alias: the asked name
        view = (await get(http, f"{base}/api/slots"))["slots"]
        loaded = next(slot for slot in view if slot["name"] == "vis-Vision-Q4_1")
        assert loaded["state"] == "ready"
        assert 100 < loaded["idle_unload_in_s"] <= 120  # the library's, not 300
        started = hal0d.named("slot.process_started")
        argv = next(line["argv"] for line in started if line["slot"] == "vis-Vision-Q4_1")
        argv = argv[argv.index("stub"):]  # the server's own arguments, after Python's -m
        assert argv[argv.index("--mmproj") + 1] == vision["mmproj"]
        assert argv[argv.index("-m") + 1] == vision["file"]
        assert (await chat(http, base, "tiny-a"))["model"] == "tiny-a"
        pinned = next(line for line in hal0d.named("slot.process_started")
                      if line["slot"] == "pinned")
        # The hand-written command, not the library's (which names the model's file).
        assert "-m" not in pinned["argv"][pinned["argv"].index("stub"):]

        tags = {model["name"]: model for model in (await get(http, f"{ollama}/api/tags"))["models"]}
        assert tags["vis/Vision-Q4_1"]["size"] == vision["size_bytes"]
        assert tags["vis/Vision-Q4_1"]["details"] | {"slot": None} == {
            "parent_model": "", "format": "gguf", "family": "llama", "families": ["llama"],
            "parameter_size": tags["vis/Vision-Q4_1"]["details"]["parameter_size"],
            "quantization_level": "Q4_1", "slot": None}
        assert tags["tiny-a"]["details"]["format"] == ""  # a hand-written slot knows no file
        async with http.post(f"{ollama}/api/show", json={"model": "tiny-a"}) as resp:
            assert (await resp.json())["model_info"]["general.architecture"] == ""
        async with http.post(f"{ollama}/api/show", json={"model": "vis/Other-Q4_1"}) as resp:
            shown = await resp.json()
        assert shown["model_info"]["llama.context_length"] == 2048
        assert shown["details"]["format"] == "gguf"
        assert shown["capabilities"] == ["completion", "tools"]  # its template reads tools
        async with http.post(f"{ollama}/api/show", json={"model": "big/Split"}) as resp:
            assert (await resp.json())["capabilities"] == ["completion"]  # no template

        code, out, err = await cli("models", "--file", str(config))
        assert code == 0, err
        rows = {line.split()[0]: line for line in out.splitlines()[1:]}
        assert set(rows) == {"big/Split", "vis/Vision-Q4_1", "vis/Other-Q4_1"}, out
        assert rows["vis/Vision-Q4_1"].split()[-1] == "ready", out
        assert rows["big/Split"].split()[-1] == "stopped", out
        assert "not served:" in err and "notes.gguf" in err, err


async def test_an_ollama_store_and_a_hugging_face_cache_one_slot_a_blob_and_a_rescan(
        tmp_path: Path, http: aiohttp.ClientSession) -> None:
    """One blob under two tags is one slot answering to every name, never two processes; a
    namespaced model keeps its namespace; a manifest whose blob is missing, and a name a later
    source claims too, are lines, and the rest is served; models added and removed are found by
    a SIGHUP and by `hal0d models --rescan`."""
    made = tmp_path / "made"
    smol = write_model(made / "smol.gguf", name="smol")[0].read_bytes()
    tiny = write_model(made / "tiny.gguf", name="tiny", context=1024)[0].read_bytes()
    store = OllamaStore(tmp_path / "ollama")
    store.pull("smol:135m", smol)
    store.pull("smol:latest", smol)
    store.pull("jmorgan/tiny:q4", tiny)
    store.pull("gone:1b", smol, missing=b"never downloaded")
    hf = HfCache(tmp_path / "hf" / "hub")
    hf.snapshot("Org/Repo-GGUF", "c0ffee", {"Repo-Q4_1.gguf": tiny + b""})
    # A folder listed last claims "smol" with another model: the store's stays.
    write_model(tmp_path / "folder" / "smol.gguf", name="another smol", layers=3)
    port, ollama_port = free_port(), free_port()
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [server]
        port = {port}

        [[library]]
        path = "{store.root}"
        command = {toml_list(STUB)}

        [[library]]
        path = "{tmp_path / 'hf'}"
        command = {toml_list(STUB)}

        [[library]]
        path = "{tmp_path / 'folder'}"
        command = {toml_list(STUB)}
    """) + common(tmp_path, ollama_port))
    async with serving(config, port) as hal0d:
        base = hal0d.url
        library = await get(http, f"{base}/api/library")
        found = by_name(library)
        assert found["smol:135m"]["names"] == ["smol:135m", "smol:latest", "smol"]
        assert found["jmorgan/tiny:q4"]["names"] == ["jmorgan/tiny:q4"]
        assert found["Org/Repo-GGUF:Repo-Q4_1"]["names"] == [
            "Org/Repo-GGUF:Repo-Q4_1", "Org/Repo-GGUF"]
        assert "gone" not in str(found)
        problems = "\n".join(library["problems"])
        assert "gone/1b" in problems and "missing" in problems, problems
        assert "smol: also named by" in problems, problems
        assert len(library["models"]) == 3  # the folder's smol lost its only name

        for name in ("smol", "smol:latest", "smol:135m"):
            assert (await chat(http, base, name))["model"] == "smol:135m"  # its main name
        starts = [line for line in hal0d.named("slot.process_started")
                  if line["slot"] == found["smol:135m"]["slot"]]
        assert len(starts) == 1, starts  # one process for the blob, whatever name it is asked by
        async with http.post(f"http://127.0.0.1:{ollama_port}/api/show",
                             json={"model": "jmorgan/tiny:q4"}) as resp:
            assert (await resp.json())["model_info"]["llama.context_length"] == 1024

        # Added: a second repository in the cache, found on SIGHUP.
        hf.snapshot("Org/New-GGUF", "beef", {"New-Q4_1.gguf": smol + b"\0" * 64})
        reloads = len(hal0d.named("config.reloaded"))
        hal0d.send(signal.SIGHUP)
        await hal0d.wait_for_count("config.reloaded", reloads + 1, timeout=10)
        assert "Org/New-GGUF" in models_of(await get(http, f"{base}/v1/models"))

        # Removed: the namespaced model's manifest, found by `hal0d models --rescan`; its slot
        # leaves, the loaded one stays.
        shutil.rmtree(store.root / "manifests" / "registry.ollama.ai" / "jmorgan")
        code, out, err = await cli("models", "--file", str(config), "--rescan")
        assert code == 0, err
        assert "jmorgan/tiny:q4" not in out and "smol:135m" in out, out
        listed = models_of(await get(http, f"{base}/v1/models"))
        assert "jmorgan/tiny:q4" not in listed and "smol" in listed
        view = {slot["name"]: slot for slot in (await get(http, f"{base}/api/slots"))["slots"]}
        assert view[found["smol:135m"]["slot"]]["state"] == "ready"  # kept its process


def test_check_and_print_config_show_what_the_libraries_find(tmp_path: Path) -> None:
    """check-config counts the models found and warns of what is not served; print-config
    prints the [[library]] table (not its slots: a rescan finds them again), and its output
    loads to the same slots; `hal0d models --config` prints the slot tables for pinning."""
    import subprocess

    folder = tmp_path / "models"
    write_model(folder / "one.gguf", name="one")
    (folder / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 12)
    config = tmp_path / "hal0d.toml"
    config.write_text(textwrap.dedent(f"""
        [[library]]
        path = "models"
        command = {toml_list(STUB)}

        [metrics]
        database = "{tmp_path / 'history.sqlite3'}"
    """))

    def hal0d(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "hal0d", *args], capture_output=True,
                              text=True, timeout=30)

    checked = hal0d("check-config", "--config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == (
        f"{config}: ok (1 slot, 1 of them models found by [[library]]) with 1 warning")
    assert "warning: library: folder" in checked.stderr and "broken.gguf" in checked.stderr
    printed = hal0d("print-config", "--config", str(config)).stdout
    assert "[[slots]]" not in printed and 'path = "models"' in printed, printed
    again = tmp_path / "printed.toml"
    again.write_text(printed)
    assert "ok (1 slot, 1 of them" in hal0d("check-config", "--config", str(again)).stdout
    tables = hal0d("models", "--config", "--file", str(config)).stdout
    assert 'name = "one"' in tables and "{free_port}" in tables, tables
    assert str(folder / "one.gguf") in tables and "--mmproj" not in tables, tables


def test_the_readmes_eight_lines_serve_a_folder_and_an_ollama_store_in_one_group(
        tmp_path: Path) -> None:
    """The newcomer's config, as the README writes it (8 lines, comments aside), with its two
    paths pointed here: three GGUFs in a folder and two Ollama models, room for two at once."""
    import re
    import subprocess

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("## Coming from Ollama", 1)[1].split("```toml\n", 1)[1].split("```")[0]
    lines = [re.sub(r"\s+#.*", "", line) for line in block.splitlines() if line.strip()]
    assert len(lines) == 8, lines
    for name in ("a", "b", "c"):
        write_model(tmp_path / "models" / f"{name}.gguf", name=name)
    store = OllamaStore(tmp_path / "ollama")
    store.pull("smollm2:135m", write_model(tmp_path / "made" / "s.gguf", name="s")[0].read_bytes())
    store.pull("tinychat", write_model(tmp_path / "made" / "t.gguf", name="t")[0].read_bytes())
    text = "\n".join(lines).replace('"/srv/models"', f'"{tmp_path / "models"}"').replace(
        '"ollama"', f'"{store.root}"')
    config = tmp_path / "hal0d.toml"
    config.write_text(text + f'\n[metrics]\ndatabase = "{tmp_path / "h.sqlite3"}"\n')
    checked = subprocess.run([sys.executable, "-m", "hal0d", "check-config", "--config",
                              str(config)], capture_output=True, text=True, timeout=30)
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.startswith(f"{config}: ok (5 slots, 5 of them models found"), (
        checked.stdout)
    tables = subprocess.run([sys.executable, "-m", "hal0d", "models", "--config", "--file",
                             str(config)], capture_output=True, text=True, timeout=30).stdout
    assert tables.count('group = "gpu"') == 5 and "tinychat:latest" in tables, tables
