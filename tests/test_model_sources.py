"""The models a homelab already has, found and named: a folder of GGUF files, Ollama's store and
the Hugging Face cache, each laid out on disk as its owner writes it, and the merge of them.

Everything here is real files, links and permissions in a temporary folder; what can go wrong
(a missing part, a loop, a broken manifest, a dangling link) is a Problem line, never a raise.
"""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from hal0d.library import (
    FoundModel,
    Problem,
    hf_root,
    merge,
    ollama_roots,
    scan_folder,
    scan_hf,
    scan_ollama,
)
from hal0d.library.folder import pair_projectors
from tests.harness.model_stores import HfCache, OllamaStore, folder_of, gguf


def by_name(models: list[FoundModel]) -> dict[str, FoundModel]:
    return {name: model for model in models for name in model.names}


def lines(problems: list[Problem]) -> list[str]:
    return [str(problem) for problem in problems]


# -- a folder of GGUF files ---------------------------------------------------------------------


def test_a_folder_names_each_model_by_its_path_below_it(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        "SmolLM2-135M-Instruct.Q4_1.gguf": gguf("smol"),
        "qwen/Qwen3-8B-Q4_K_M.gguf": gguf("qwen3") + bytes(100),
        "qwen/README.md": b"# not a model, passed by in silence",
    })
    models, problems = scan_folder(root)
    assert problems == []
    assert [model.names for model in models] == [("SmolLM2-135M-Instruct.Q4_1",),
                                                 ("qwen/Qwen3-8B-Q4_K_M",)]
    qwen = models[1]
    assert qwen.source == f"folder {root}"
    assert qwen.parts == (root / "qwen" / "Qwen3-8B-Q4_K_M.gguf",)
    assert qwen.mmproj is None
    assert qwen.identity == os.path.realpath(qwen.parts[0])
    assert qwen.size_bytes == len(gguf("qwen3")) + 100


def test_split_files_are_one_model_in_order_and_a_missing_part_is_reported(
        tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        # Written out of order: the parts come back in order all the same.
        "big/Llama-70B-Q4_K_M-00003-of-00003.gguf": gguf("3"),
        "big/Llama-70B-Q4_K_M-00001-of-00003.gguf": gguf("1"),
        "big/Llama-70B-Q4_K_M-00002-of-00003.gguf": gguf("2"),
        "half/Half-00001-of-00003.gguf": gguf("h1"),
        "half/Half-00003-of-00003.gguf": gguf("h3"),
    })
    models, problems = scan_folder(root)
    [big] = models
    assert big.names == ("big/Llama-70B-Q4_K_M",)
    assert big.parts == tuple(root / "big" / f"Llama-70B-Q4_K_M-0000{n}-of-00003.gguf"
                              for n in (1, 2, 3))
    assert big.size_bytes == 3 * len(gguf("1"))
    assert lines(problems) == [
        f"folder {root}: half/Half-00001-of-00003.gguf: split model Half: part(s) "
        "Half-00002-of-00003.gguf missing; not served"]


def test_a_projector_goes_with_the_model_whose_name_it_shares(tmp_path: Path) -> None:
    """Two models in one folder, so the pairing is by name; a folder with one model pairs its
    projector whatever the names; a projector that fits no model is a line, not fatal."""
    root = folder_of(tmp_path / "models", {
        "vision/Qwen2.5-VL-7B-Instruct-Q4_K_M.gguf": gguf("vl"),
        "vision/Qwen2.5-7B-Instruct-Q4_K_M.gguf": gguf("text"),
        "vision/mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf": gguf("proj"),
        "gemma/gemma-3-4b-it-Q4_K_M.gguf": gguf("gemma"),
        "gemma/mmproj-F16.gguf": gguf("gemma proj"),
        "odd/Llama-3-8B.gguf": gguf("a"),
        "odd/Mistral-7B.gguf": gguf("b"),
        "odd/mmproj-f16.gguf": gguf("whose?"),
    })
    models, problems = scan_folder(root)
    named = by_name(models)
    assert named["vision/Qwen2.5-VL-7B-Instruct-Q4_K_M"].mmproj == (
        root / "vision" / "mmproj-Qwen2.5-VL-7B-Instruct-f16.gguf")
    assert named["vision/Qwen2.5-7B-Instruct-Q4_K_M"].mmproj is None
    assert named["gemma/gemma-3-4b-it-Q4_K_M"].mmproj == root / "gemma" / "mmproj-F16.gguf"
    assert "vision/mmproj-Qwen2.5-VL-7B-Instruct-f16" not in named  # a projector is no model
    assert named["odd/Llama-3-8B"].mmproj is None
    assert lines(problems) == [
        f"folder {root}: odd/mmproj-f16.gguf: a projector (mmproj) whose name shares nothing "
        "with the 2 models of its folder"]


def test_quantizations_of_one_model_share_its_projector(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        "gemma-3-4b-it-Q4_K_M.gguf": gguf("q4"),
        "gemma-3-4b-it-Q8_0.gguf": gguf("q8"),
        "mmproj-gemma-3-4b-it-f16.gguf": gguf("proj16"),
        "mmproj-gemma-3-4b-it-f32.gguf": gguf("proj32"),
    })
    models, problems = scan_folder(root)
    assert {model.mmproj for model in models} == {root / "mmproj-gemma-3-4b-it-f16.gguf"}
    assert lines(problems) == [
        f"folder {root}: mmproj-gemma-3-4b-it-f32.gguf: a projector (mmproj) not used: its "
        "model is paired with one whose name is closer"]


def test_pairing_by_name_is_the_longest_shared_prefix() -> None:
    paired, unpaired = pair_projectors(
        ["llava-v1.6-mistral-7b.Q4_K_M", "llava-v1.5-7b-Q4_K"],
        [Path("mmproj-llava-v1.5-7b-f16.gguf"), Path("llava-v1.6-mistral-7b.mmproj-f16.gguf")])
    assert paired == {0: Path("llava-v1.6-mistral-7b.mmproj-f16.gguf"),
                      1: Path("mmproj-llava-v1.5-7b-f16.gguf")}
    assert unpaired == []
    paired, unpaired = pair_projectors([], [Path("mmproj-x.gguf")])
    assert (paired, unpaired) == ({}, [(Path("mmproj-x.gguf"),
                                        "a projector (mmproj) with no model in its folder")])


def test_a_projector_test_handed_in_decides_and_its_failure_is_that_files_problem(
        tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        "model.gguf": gguf("m"), "clip-vision.gguf": gguf("clip"), "broken.gguf": gguf("b")})

    def by_header(path: Path) -> bool:  # stands in for a reader of GGUF headers
        if path.name == "broken.gguf":
            raise ValueError("truncated header")
        return path.name.startswith("clip")

    models, problems = scan_folder(root, is_projector=by_header)
    assert [(model.names, model.mmproj) for model in models] == [
        (("model",), root / "clip-vision.gguf")]
    assert lines(problems) == [f"folder {root}: broken.gguf: cannot tell whether it is a "
                               "projector: truncated header"]


def test_a_gguf_file_without_the_magic_is_reported_and_other_files_are_ignored(
        tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        "real.gguf": gguf("real"),
        "notes/fake.gguf": b"<html>404 Not Found</html>",
        "notes/empty.GGUF": b"",
        "notes/model.safetensors": b"{}",
        "notes/partial.gguf.part": b"GG",
    })
    models, problems = scan_folder(root)
    assert [model.names for model in models] == [("real",)]
    assert lines(problems) == [
        f"folder {root}: notes/empty.GGUF: not a GGUF file (it does not start with the GGUF "
        "magic)",
        f"folder {root}: notes/fake.gguf: not a GGUF file (it does not start with the GGUF "
        "magic)"]


def test_hidden_files_and_folders_are_skipped(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {
        "seen.gguf": gguf("seen"),
        ".hidden/Secret.gguf": gguf("secret"),
        ".Trash-1000/files/old.gguf": gguf("old"),
        "sub/.partial.gguf": b"not even GGUF",
    })
    models, problems = scan_folder(root)
    assert [model.names for model in models] == [("seen",)]
    assert problems == []


@pytest.mark.skipif(os.geteuid() == 0,
                    reason="root reads a folder whatever its mode, so chmod cannot lock it")
def test_an_unreadable_folder_is_reported_and_the_rest_served(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {"open/Open.gguf": gguf("open"),
                                           "locked/Locked.gguf": gguf("locked")})
    (root / "locked").chmod(0)
    try:
        models, problems = scan_folder(root)
    finally:
        (root / "locked").chmod(0o755)
    assert [model.names for model in models] == [("open/Open",)]
    assert lines(problems) == [
        f"folder {root}: locked: this folder cannot be read: Permission denied"]


def scan_within(root: Path, seconds: float = 10.0) -> tuple[list[FoundModel], list[Problem]]:
    """scan_folder(root), failing the test if it has not returned after `seconds`."""
    done: list[tuple[list[FoundModel], list[Problem]]] = []
    worker = threading.Thread(target=lambda: done.append(scan_folder(root)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"scan_folder({root}) still running after {seconds} s"
    [result] = done
    return result


def test_a_symlink_loop_is_reported_and_the_scan_ends(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {"a/Model.gguf": gguf("m")})
    (root / "a" / "back").symlink_to("..")  # models/a/back -> models
    (root / "knot1").symlink_to("knot2")  # two links naming each other
    (root / "knot2").symlink_to("knot1")
    models, problems = scan_within(root)
    assert [model.names for model in models] == [("a/Model",)]
    assert lines(problems) == [f"folder {root}: knot1: a symlink loop",
                               f"folder {root}: knot2: a symlink loop",
                               f"folder {root}: a/back: a symlink loop: it leads back to ."]


def test_links_are_followed_and_a_file_reached_twice_is_one_model(tmp_path: Path) -> None:
    other_disk = folder_of(tmp_path / "disk2", {"Big-Q8_0.gguf": gguf("big"),
                                                "deep/Deep.gguf": gguf("deep")})
    root = folder_of(tmp_path / "models", {"Small.gguf": gguf("small")})
    (root / "big").symlink_to(other_disk)  # a folder linked in from another disk
    (root / "also-big").symlink_to(other_disk)  # the same folder again: read once
    (root / "alias.gguf").symlink_to("Small.gguf")
    (root / "Gone.gguf").symlink_to(tmp_path / "nowhere.gguf")
    models, problems = scan_within(root)
    assert [(model.names, model.parts) for model in models] == [
        (("Small", "alias"), (root / "Small.gguf",)),
        (("also-big/Big-Q8_0",), (root / "also-big" / "Big-Q8_0.gguf",)),
        (("also-big/deep/Deep",), (root / "also-big" / "deep" / "Deep.gguf",)),
    ]
    assert models[1].identity == str(other_disk / "Big-Q8_0.gguf")
    assert lines(problems) == [
        f"folder {root}: Gone.gguf: a link to {tmp_path / 'nowhere.gguf'}, which is missing"]


def test_a_root_that_is_not_a_folder_is_one_problem(tmp_path: Path) -> None:
    assert scan_folder(tmp_path / "absent") == (
        [], [Problem(f"folder {tmp_path / 'absent'}", str(tmp_path / "absent"),
                     "does not exist")])
    (tmp_path / "file.gguf").write_bytes(gguf())
    _, [problem] = scan_folder(tmp_path / "file.gguf")
    assert problem.what == "not a folder"


# -- Ollama's store -----------------------------------------------------------------------------


def test_ollama_models_are_named_as_ollama_shows_them(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path / "ollama")
    store.pull("qwen3:8b", gguf("qwen3"))
    store.pull("jmorgan/tiny:q4", gguf("tiny"))
    store.pull("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M", gguf("hf"))
    store.pull("hf.co/bartowski/SmolLM2-GGUF", gguf("hf latest"))
    models, problems = scan_ollama(store.root)
    assert problems == []
    assert sorted(model.names for model in models) == [
        ("hf.co/bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M",),
        ("hf.co/bartowski/SmolLM2-GGUF:latest", "hf.co/bartowski/SmolLM2-GGUF"),
        ("jmorgan/tiny:q4",),
        ("qwen3:8b",),
    ]
    qwen = by_name(models)["qwen3:8b"]
    blob = store.root / "blobs" / str(store.blob(gguf("qwen3"))["digest"]).replace(":", "-")
    assert qwen.parts == (blob,)
    assert qwen.identity == str(blob)
    assert qwen.size_bytes == len(gguf("qwen3"))
    assert qwen.source == f"ollama {store.root}"


def test_one_blob_under_two_tags_is_one_model_with_both_names(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path / "ollama")
    store.pull("llama3.2:latest", gguf("3b"))
    store.pull("llama3.2:3b", gguf("3b"))
    store.pull("llama3.2:1b", gguf("1b"))
    models, problems = scan_ollama(store.root)
    assert problems == []
    assert sorted(model.names for model in models) == [
        ("llama3.2:1b",), ("llama3.2:3b", "llama3.2:latest", "llama3.2")]


def test_ollama_problems_are_lines_and_the_rest_is_served(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path / "ollama")
    store.pull("good:latest", gguf("good"))
    store.pull("gone:latest", gguf(), missing=gguf("never written"))
    store.write_manifest("broken:latest", '{"schemaVersion": 2, "layers": [')
    store.write_manifest("cloud:latest", store.manifest_text([]))
    store.pull("lora:latest", gguf("base"), adapter=b"lora weights")
    store.pull("fake:latest", b"<html>not weights</html>")
    store.write_manifest("Bad Name:latest", store.manifest_text([]))
    models, problems = scan_ollama(store.root)
    assert [model.names for model in models] == [("good:latest", "good")]
    missing = hashlib.sha256(gguf("never written")).hexdigest()
    fake = hashlib.sha256(b"<html>not weights</html>").hexdigest()
    shown = f"ollama {store.root}: manifests/registry.ollama.ai/library"
    assert lines(problems) == [
        f"{shown}/Bad Name/latest: 'Bad Name' is not a valid model in an Ollama name; Ollama "
        "skips it too",
        f"{shown}/broken/latest: not a manifest Ollama can read (not JSON: Expecting value: "
        "line 1 column 33 (char 32))",
        f"{shown}/cloud/latest: no model layer (a cloud model, or weights Ollama keeps in "
        "another format than GGUF): not served",
        f"{shown}/fake/latest: model blob sha256-{fake}: not a GGUF file (it does not start "
        "with the GGUF magic)",
        f"{shown}/gone/latest: names blob sha256-{missing[:12]}... which is missing",
        f"{shown}/lora/latest: has a LoRA adapter layer, which hal0d does not apply; not "
        "served, as its base weights alone would answer differently",
    ]


def test_an_ollama_projector_layer_is_the_models_mmproj(tmp_path: Path) -> None:
    store = OllamaStore(tmp_path / "ollama")
    store.pull("llava:7b", gguf("llava"), projector=gguf("clip"))
    [llava], problems = scan_ollama(store.root)
    assert problems == []
    assert llava.mmproj == store.root / "blobs" / str(
        store.blob(gguf("clip"))["digest"]).replace(":", "-")


def test_a_folder_that_is_no_ollama_store_is_one_problem(tmp_path: Path) -> None:
    assert lines(scan_ollama(tmp_path)[1]) == [
        f"ollama {tmp_path}: {tmp_path}: no manifests folder: not an Ollama model store"]


def test_ollama_roots_are_the_stores_that_exist(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    configured = tmp_path / "configured"
    (configured / "manifests").mkdir(parents=True)
    home = tmp_path / "home"
    (home / ".ollama" / "models").mkdir(parents=True)
    monkeypatch.setenv("OLLAMA_MODELS", str(configured))
    monkeypatch.setenv("HOME", str(home))
    roots = ollama_roots()
    assert roots[:2] == [configured, home / ".ollama" / "models"]
    assert all(root.is_dir() for root in roots)
    monkeypatch.setenv("OLLAMA_MODELS", str(home / ".ollama" / "models"))  # the same store
    assert ollama_roots()[:1] == [home / ".ollama" / "models"]
    assert ollama_roots().count(home / ".ollama" / "models") == 1


# -- the Hugging Face cache ---------------------------------------------------------------------


def test_refs_main_picks_the_snapshot(tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    cache.snapshot("Qwen/Qwen3-0.6B-GGUF", "a" * 40, {"Qwen3-0.6B-Q8_0.gguf": gguf("new")},
                   mtime=1_000)
    cache.snapshot("Qwen/Qwen3-0.6B-GGUF", "b" * 40, {"Qwen3-0.6B-Q8_0.gguf": gguf("newer")},
                   main=False, mtime=2_000)
    [model], problems = scan_hf(cache.root)
    assert problems == []
    assert model.names == ("Qwen/Qwen3-0.6B-GGUF:Qwen3-0.6B-Q8_0", "Qwen/Qwen3-0.6B-GGUF")
    assert model.parts == (cache.repo("Qwen/Qwen3-0.6B-GGUF") / "snapshots" / ("a" * 40)
                           / "Qwen3-0.6B-Q8_0.gguf",)
    assert Path(model.identity).read_bytes() == gguf("new")
    assert model.source == f"hf {cache.root}"


def test_without_refs_main_the_newest_snapshot_is_read(tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    cache.snapshot("org/repo", "c" * 40, {"m.gguf": gguf("old")}, main=False, mtime=1_000)
    cache.snapshot("org/repo", "d" * 40, {"m.gguf": gguf("new")}, main=False, mtime=2_000)
    [model], _ = scan_hf(cache.root)
    assert Path(model.identity).read_bytes() == gguf("new")


def test_a_repository_of_several_files_names_each_by_its_stem(tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    cache.snapshot("unsloth/Qwen3-30B-A3B-GGUF", "e" * 40, {
        "Qwen3-30B-A3B-Q4_K_M.gguf": gguf("q4"),
        "Qwen3-30B-A3B-Q8_0.gguf": gguf("q8"),
        "BF16/Qwen3-30B-A3B-BF16-00001-of-00002.gguf": gguf("bf1"),
        "BF16/Qwen3-30B-A3B-BF16-00002-of-00002.gguf": gguf("bf2"),
        "README.md": b"# a model card",
        "config.json": b"{}",
    })
    cache.snapshot("gpt2", "f" * 40, {"gpt2-f16.gguf": gguf("no organisation")})
    folder_of(cache.root, {f"datasets--org--data/snapshots/{'f' * 40}/x.gguf": gguf("data")})
    models, problems = scan_hf(cache.root)
    assert problems == []
    repo = "unsloth/Qwen3-30B-A3B-GGUF"
    named = by_name(models)
    assert sorted(model.names for model in models) == [
        ("gpt2:gpt2-f16", "gpt2"), (f"{repo}:Qwen3-30B-A3B-BF16",),
        (f"{repo}:Qwen3-30B-A3B-Q4_K_M",), (f"{repo}:Qwen3-30B-A3B-Q8_0",)]
    assert [part.name for part in named[f"{repo}:Qwen3-30B-A3B-BF16"].parts] == [
        "Qwen3-30B-A3B-BF16-00001-of-00002.gguf", "Qwen3-30B-A3B-BF16-00002-of-00002.gguf"]


def test_a_dangling_link_in_a_snapshot_is_reported(tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    snapshot = cache.snapshot("ggml-org/gemma-3-4b-it-GGUF", "0" * 40, {
        "gemma-3-4b-it-Q4_K_M.gguf": None,  # its blob never arrived
        "mmproj-model-f16.gguf": gguf("proj"),
    })
    models, problems = scan_hf(cache.root)
    assert models == []
    link = snapshot / "gemma-3-4b-it-Q4_K_M.gguf"
    assert lines(problems) == [
        f"hf {cache.root}: models--ggml-org--gemma-3-4b-it-GGUF/snapshots/{'0' * 40}/"
        f"gemma-3-4b-it-Q4_K_M.gguf: a link to {os.readlink(link)}, which is missing",
        f"hf {cache.root}: models--ggml-org--gemma-3-4b-it-GGUF/snapshots/{'0' * 40}/"
        "mmproj-model-f16.gguf: a projector (mmproj) with no model in its folder"]


def test_a_vision_repository_pairs_its_projector(tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    snapshot = cache.snapshot("ggml-org/gemma-3-4b-it-GGUF", "1" * 40, {
        "gemma-3-4b-it-Q4_K_M.gguf": gguf("gemma"), "mmproj-model-f16.gguf": gguf("proj")})
    [model], problems = scan_hf(cache.root)
    assert problems == []
    assert model.names == ("ggml-org/gemma-3-4b-it-GGUF:gemma-3-4b-it-Q4_K_M",
                           "ggml-org/gemma-3-4b-it-GGUF")
    assert model.mmproj == snapshot / "mmproj-model-f16.gguf"


def test_hf_root_follows_huggingface_hubs_variables(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert hf_root() == tmp_path / ".cache" / "huggingface" / "hub"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hf_root() == tmp_path / "xdg" / "huggingface" / "hub"
    monkeypatch.setenv("HF_HOME", "~/hf")
    assert hf_root() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert hf_root() == tmp_path / "hub"


# -- merging sources ----------------------------------------------------------------------------


def test_a_file_in_a_folder_and_in_the_hf_cache_is_one_model_with_both_names(
        tmp_path: Path) -> None:
    cache = HfCache(tmp_path / "hub")
    snapshot = cache.snapshot("bartowski/SmolLM2-135M-Instruct-GGUF", "2" * 40,
                              {"SmolLM2-135M-Instruct-Q4_K_M.gguf": gguf("smol")})
    root = folder_of(tmp_path / "models", {"Other.gguf": gguf("other")})
    (root / "smol.gguf").symlink_to(snapshot / "SmolLM2-135M-Instruct-Q4_K_M.gguf")
    models, problems = merge(scan_folder(root), scan_hf(cache.root))
    assert problems == []
    assert [(model.names, model.source) for model in models] == [
        (("Other",), f"folder {root}"),
        (("smol", "bartowski/SmolLM2-135M-Instruct-GGUF:SmolLM2-135M-Instruct-Q4_K_M",
          "bartowski/SmolLM2-135M-Instruct-GGUF"), f"folder {root}"),
    ]
    assert models[1].parts == (root / "smol.gguf",)


def test_a_name_two_models_claim_stays_with_the_first_source(tmp_path: Path) -> None:
    root = folder_of(tmp_path / "models", {"llama3.2.gguf": gguf("mine")})
    store = OllamaStore(tmp_path / "ollama")
    store.pull("llama3.2:latest", gguf("ollama's"))
    folder, ollama = scan_folder(root), scan_ollama(store.root)
    models, problems = merge(folder, ollama)
    blob = ollama[0][0].parts[0]
    assert [model.names for model in models] == [("llama3.2",), ("llama3.2:latest",)]
    assert lines(problems) == [
        f"ollama {store.root}: {blob}: llama3.2: also named by folder {root}: "
        f"{root / 'llama3.2.gguf'} (kept: that one; it is served as llama3.2:latest)"]
    models, problems = merge(ollama, folder)  # the other order of preference
    assert [model.names for model in models] == [("llama3.2:latest", "llama3.2")]
    assert lines(problems) == [
        f"folder {root}: {root / 'llama3.2.gguf'}: llama3.2: also named by ollama "
        f"{store.root}: {blob} (kept: that one; it has no other name and is not served)"]


def test_merge_is_deterministic_whatever_order_the_finds_come_in() -> None:
    def find(name: str, path: str, source: str = "folder /m", real: str = "") -> FoundModel:
        return FoundModel((name,), source, (Path(path),), None, real or path, 1)

    finds = [find("c", "/m/c"), find("a", "/m/a"), find("b", "/m/b"),
             find("a-link", "/m/a-link", real="/m/a"), find("b", "/m/c2", real="/m/c")]
    ollama = [find("z", "/o/z", "ollama /o"), find("a", "/o/a", "ollama /o")]
    forward = merge((finds, []), (ollama, []))
    backward = merge((finds[::-1], []), (ollama[::-1], []))
    assert forward == backward
    assert [model.names for model in forward[0]] == [("a", "a-link"), ("b",), ("c",), ("z",)]
    assert lines(forward[1]) == [
        "folder /m: /m/c2: b: also named by folder /m: /m/b (kept: that one; it is served as c)",
        "ollama /o: /o/a: a: also named by folder /m: /m/a (kept: that one; it has no other "
        "name and is not served)"]
