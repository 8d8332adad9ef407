"""What a GGUF file says about itself, read back from real files gguf's own writer made
(tests/harness/gguf_files.py): the facts, split parts summed, the memory estimate's arithmetic,
every kind of broken file as one UnreadableModel with a reason, and the cache.

The tensors' element and byte counts are checked against gguf's stock GGUFReader, which reads
every tensor of the file its own way."""

from __future__ import annotations

import os
import shutil
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType, GGUFReader, LlamaFileType

from hal0d.library.gguf_facts import (
    MIB,
    ModelFacts,
    UnreadableModel,
    human_number,
    read_facts,
)
from tests.harness.gguf_files import write_model, write_projector

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def stock_sums(*parts: Path) -> tuple[int, int]:
    """(elements, bytes) of every tensor in the parts, as gguf's own reader counts them."""
    tensors = [tensor for part in parts for tensor in GGUFReader(part).tensors]
    return sum(int(t.n_elements) for t in tensors), sum(int(t.n_bytes) for t in tensors)


def unreadable(first: Path, parts: list[Path] | None = None) -> UnreadableModel:
    with pytest.raises(UnreadableModel) as caught:
        read_facts(first, parts or [])
    assert "\n" not in str(caught.value)
    return caught.value


def cut(path: Path, size: int) -> Path:
    with path.open("r+b") as file:
        file.truncate(size)
    return path


def data_start(path: Path) -> int:
    return int(GGUFReader(path).data_offset)


# -- the facts --------------------------------------------------------------------------------

def test_a_model_reads_back_as_it_was_written(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "tiny.gguf", name="tiny", context=4096, layers=3, heads=4,
                         kv_heads=2, embedding=64, template=TEMPLATE)
    facts = read_facts(path)
    elements, weights = stock_sums(path)
    assert facts == ModelFacts(
        architecture="llama", name="tiny", parameters=elements, quantization="Q4_1",
        file_bytes=path.stat().st_size, context_length=4096, layers=3, head_count=4,
        kv_heads=2, key_length=16, value_length=16, embedding_length=64, sliding_window=None,
        chat_template=TEMPLATE, is_projector=False, weights_bytes=weights, family="llama")
    assert 0 < weights < facts.file_bytes


def test_the_written_parameter_count_wins_over_the_tensors_sum(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf", parameter_count=7_241_732_096)
    facts = read_facts(path)
    assert (facts.parameters, facts.parameter_size) == (7_241_732_096, "7.2B")


@pytest.mark.parametrize(("file_type", "tensor_type", "quantization"), [
    (LlamaFileType.MOSTLY_Q4_K_M, GGMLQuantizationType.Q4_K, "Q4_K_M"),
    (LlamaFileType.MOSTLY_F16, GGMLQuantizationType.F16, "F16"),
    (LlamaFileType.ALL_F32, GGMLQuantizationType.F32, "F32"),
    (LlamaFileType.MOSTLY_Q8_0, GGMLQuantizationType.Q8_0, "Q8_0"),
    # No general.file_type, a guessed one, one newer than gguf knows: the tensor type that
    # holds the most elements (not F32, which the norms are: more tensors, fewer elements).
    (None, GGMLQuantizationType.Q8_0, "Q8_0"),
    (LlamaFileType.GUESSED, GGMLQuantizationType.Q5_1, "Q5_1"),
    (999, GGMLQuantizationType.Q4_0, "Q4_0"),
])
def test_quantization_is_named_as_ollama_names_it(
        tmp_path: Path, file_type: int | None, tensor_type: GGMLQuantizationType,
        quantization: str) -> None:
    [path] = write_model(tmp_path / "m.gguf", file_type=file_type, tensor_type=tensor_type,
                         layers=1)
    assert read_facts(path).quantization == quantization


def test_head_sizes_come_from_the_file_when_it_gives_them(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf", heads=4, embedding=64, key_length=32,
                         value_length=24, sliding_window=512)
    facts = read_facts(path)
    assert (facts.key_length, facts.value_length, facts.sliding_window) == (32, 24, 512)


def test_kv_heads_default_to_the_head_count(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf", heads=4, kv_heads=None)
    assert read_facts(path).kv_heads == 4


def test_kv_heads_given_a_layer_are_kept_a_layer(tmp_path: Path) -> None:
    """A hybrid model: its recurrent layers hold no KV cache."""
    [path] = write_model(tmp_path / "m.gguf", layers=4, heads=4, kv_heads=[0, 2, 0, 2])
    facts = read_facts(path)
    assert (facts.kv_heads, facts.kv_heads_per_layer) == (2, (0, 2, 0, 2))
    assert facts.kv_bytes(1000) == 1000 * (0 + 2 + 0 + 2) * (16 * 2 + 16 * 2)


def test_a_projector_is_known_as_one(tmp_path: Path) -> None:
    path = write_projector(tmp_path / "mmproj.gguf", name="vision")
    facts = read_facts(path)
    assert (facts.architecture, facts.family, facts.name, facts.is_projector) == \
        ("clip", "clip", "vision", True)
    assert (facts.layers, facts.context_length, facts.quantization) == (None, None, "F16")
    assert facts.weights_bytes == stock_sums(path)[1]
    assert facts.kv_bytes(4096) == 0


def test_split_parts_add_up(tmp_path: Path) -> None:
    parts = write_model(tmp_path / "big.gguf", split=3, name="big", template=TEMPLATE)
    assert [p.name for p in parts] == [f"big-0000{n}-of-00003.gguf" for n in (1, 2, 3)]
    facts = read_facts(parts[0], parts[1:])
    [whole] = write_model(tmp_path / "whole.gguf", name="big", template=TEMPLATE)
    assert stock_sums(*parts) == stock_sums(whole)
    assert (facts.parameters, facts.weights_bytes) == stock_sums(whole)
    assert facts.file_bytes == sum(p.stat().st_size for p in parts)
    assert (facts.name, facts.chat_template, facts.layers) == ("big", TEMPLATE, 2)


def test_a_split_model_needs_all_its_parts_first_part_first(tmp_path: Path) -> None:
    parts = write_model(tmp_path / "big.gguf", split=3)
    assert str(unreadable(parts[0], parts[1:2])) == "split in 3 parts, 2 given"
    assert str(unreadable(parts[1], [parts[0], parts[2]])) == \
        "part 2 of 3 of a split model, not its first"


@pytest.mark.parametrize(("count", "shown"), [
    (0, "0"), (999, "999"), (1000, "1K"), (1001, "1K"), (1_000_000, "1M"),
    (125_000_000, "125M"), (134_515_008, "134.52M"), (500_500_000, "500.50M"),
    (1_000_000_000, "1B"), (1_711_376_384, "1.7B"), (2_850_000_000, "2.9B"),
    (7_241_732_096, "7.2B"), (70_000_000_000, "70B"), (70_553_706_496, "70.6B"),
])
def test_parameter_size_is_written_as_ollama_writes_it(count: int, shown: str) -> None:
    assert human_number(count) == shown


# -- the estimate -----------------------------------------------------------------------------

def test_the_estimate_is_the_weights_and_the_kv_cache_at_the_context(tmp_path: Path) -> None:
    """2 layers x 2 KV heads x 16-wide heads: 128 bytes a token for K and V in f16."""
    [path] = write_model(tmp_path / "m.gguf", layers=2, heads=4, kv_heads=2, embedding=64)
    facts = read_facts(path)
    weights = stock_sums(path)[1]
    assert facts.kv_bytes(4096) == 2 * 4096 * 2 * (16 * 2 + 16 * 2) == 1 * MIB
    assert facts.estimate_mib(4096) == -(-(weights + MIB) // MIB)
    # q8_0 stores 32 elements in 34 bytes, q4_0 in 18.
    assert facts.kv_bytes(4096, "q8_0", "q4_0") == 2 * 4096 * 2 * (17 + 9)
    assert facts.kv_bytes(0) == 0
    projector = read_facts(write_projector(tmp_path / "mmproj.gguf"))
    assert facts.estimate_mib(4096, projector=projector) == \
        -(-(weights + MIB + projector.weights_bytes) // MIB)


def test_an_unknown_cache_type_is_refused(tmp_path: Path) -> None:
    facts = read_facts(write_model(tmp_path / "m.gguf")[0])
    with pytest.raises(ValueError, match="unknown KV cache type 'q3_k'"):
        facts.kv_bytes(2048, cache_type_k="q3_k")


# -- files that are not readable models -------------------------------------------------------

def test_a_file_cut_in_its_header_is_truncated(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf", vocabulary=2000)  # a token array stepped over
    end = data_start(path)
    for size in (2, 6, 30, 200, end // 2, end - 1):
        cut(Path(shutil.copy(path, tmp_path / f"cut{size}.gguf")), size)
        assert str(unreadable(tmp_path / f"cut{size}.gguf")) == \
            f"truncated (ends at byte {size} of its header)"


def test_a_file_cut_in_its_tensor_data_is_truncated(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf")
    size = (data_start(path) + path.stat().st_size) // 2
    reason = str(unreadable(cut(path, size)))
    assert reason.startswith(f"truncated (ends at byte {size}, inside its tensor data: "), reason


def test_a_cut_part_is_named(tmp_path: Path) -> None:
    parts = write_model(tmp_path / "big.gguf", split=3)
    cut(parts[2], 100)
    error = unreadable(parts[0], parts[1:])
    assert str(error) == "part big-00003-of-00003.gguf: truncated (ends at byte 100 of its header)"
    assert error.path == parts[2]


def test_a_file_of_another_kind_is_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    assert str(unreadable(path)) == "not a GGUF file (starts with b'PK\\x03\\x04')"


def test_an_empty_file_a_folder_and_a_missing_file(tmp_path: Path) -> None:
    (tmp_path / "empty.gguf").touch()
    (tmp_path / "folder.gguf").mkdir()
    assert str(unreadable(tmp_path / "empty.gguf")) == "empty"
    assert str(unreadable(tmp_path / "folder.gguf")) == "not a file"
    assert str(unreadable(tmp_path / "gone.gguf")) == "cannot be read (No such file or directory)"


def test_a_file_without_read_permission_cannot_be_read(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf")
    path.chmod(0)
    if os.access(path, os.R_OK):
        pytest.skip("running as root, which reads a file whatever its mode says")
    assert str(unreadable(path)) == "cannot be read (Permission denied)"


def test_an_unknown_version_is_a_corrupt_header(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf")
    with path.open("r+b") as file:
        file.seek(4)
        file.write((99).to_bytes(4, "little"))
    assert str(unreadable(path)).startswith("corrupt header (")


def test_every_cut_and_every_broken_header_byte_ends_as_unreadable_or_as_facts(
        tmp_path: Path) -> None:
    """GGUFReader raises whatever numpy or struct raise on a bad file; read_facts lets none of
    it out."""
    [path] = write_model(tmp_path / "m.gguf", name="n", template="t", layers=1, vocabulary=2)
    original = path.read_bytes()
    end = data_start(path)
    # A file a probe: two writes of one file in the same tick of the file system's clock
    # would look unchanged to the cache.
    for size in range(1, end + 64):
        (probe := tmp_path / f"cut{size}.gguf").write_bytes(original[:size])
        unreadable(probe)
    for offset in range(4, end):
        broken = bytearray(original)
        broken[offset] ^= 0xFF
        (probe := tmp_path / f"broken{offset}.gguf").write_bytes(bytes(broken))
        try:
            read_facts(probe)
        except UnreadableModel as error:
            assert str(error) and "\n" not in str(error)


def test_a_large_vocabulary_is_stepped_over_not_loaded(tmp_path: Path) -> None:
    """gguf's reader makes numpy views of every token (about 2 KB each, all kept); read_facts
    keeps only the arrays' lengths."""
    [path] = write_model(tmp_path / "m.gguf", vocabulary=100_000)
    tracemalloc.start()
    try:
        read_facts(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * MIB, peak


# -- the cache --------------------------------------------------------------------------------

def test_an_unchanged_file_is_read_once(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf")
    (tmp_path / "link.gguf").symlink_to(path)
    facts = read_facts(path)
    assert read_facts(path) is facts
    assert read_facts(tmp_path / "link.gguf") is facts  # the same file by its real path


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    [path] = write_model(tmp_path / "m.gguf", context=2048)
    before = read_facts(path)
    modified = path.stat().st_mtime_ns
    write_model(path, context=4096)  # the same size: only the modification time tells
    os.utime(path, ns=(modified + 10**9, modified + 10**9))
    after = read_facts(path)
    assert (before.context_length, after.context_length) == (2048, 4096)
    assert before.file_bytes == after.file_bytes
