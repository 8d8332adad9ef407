"""What a GGUF model file says about itself, and what it will take in memory under llama-server.

`read_facts` reads a model's header (its metadata and the list of its tensors) and returns the
facts a library shows and plans with: architecture, parameters, quantization, the trained
context, the attention's shape, the chat template, whether it is a vision projector. Its weights
are never read: a 40 GB file costs what its few megabytes of header cost.

A library is scanned often, so:
- gguf's own GGUFReader reads the header, memory-mapped; two of its habits are bounded here
  (`_HeaderReader`): it would turn every element of the tokenizer's arrays into numpy views
  (4 s and 300 MB for SmolLM2's 49k-token vocabulary; a 256k vocabulary takes five times that),
  so an array longer than KEPT_ARRAY_LENGTH is stepped over and only its length is kept; and it
  reports a file that ends too soon as whatever numpy raised, so reading past the end is caught
  where it happens and named: in the header or in the tensor data.
- the facts of a file are kept while every one of its parts has the same real path, size and
  modification time: a rescan of an unchanged folder opens nothing. A failure is not kept (a
  chmod that makes a file readable changes neither size nor mtime).
- every way a file can be wrong ends as one UnreadableModel whose message a user can act on.

The estimate is llama-server's own accounting (its log's "model buffer size" and "KV buffer
size"): the tensor data, plus a KV cache of `-c` cells in all, however its `--parallel` slots
share them (each slot gets `-c / --parallel` cells, or with the unified cache all of them, but
the buffer holds `-c` cells either way). It counts every attention layer at the full context;
llama-server keeps less for sliding-window layers unless told `--swa-full`, and none for a
hybrid model's recurrent layers (their per-layer KV head count is 0, which is counted as such).
"""

from __future__ import annotations

import math
import os
import stat
import struct
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
import numpy.typing as npt
from gguf import GGUFReader, GGUFValueType, LlamaFileType

MAGIC: Final = b"GGUF"
MIB: Final = 1024 * 1024
# Arrays up to this long are read as GGUFReader reads them (per-layer head counts, languages,
# tags); longer ones are the tokenizer's, which no fact needs.
KEPT_ARRAY_LENGTH: Final = 1024
CACHE_ENTRIES: Final = 4096
# Bytes a KV cache element takes, by llama-server's --cache-type-k/-v names: quantized types
# store blocks of 32 elements.
CACHE_TYPE_BYTES: Final = {
    "f32": Fraction(4), "f16": Fraction(2), "bf16": Fraction(2),
    "q8_0": Fraction(34, 32), "q4_0": Fraction(18, 32), "q4_1": Fraction(20, 32),
    "q5_0": Fraction(22, 32), "q5_1": Fraction(24, 32), "iq4_nl": Fraction(18, 32),
}
ARRAY_HEADER_BYTES: Final = 4 + 8  # an array's element type (uint32) and length (uint64)


class UnreadableModel(Exception):
    """A file that is not a readable GGUF model; str() is one line a user can act on, e.g.
    "not a GGUF file (starts with b'PK\\x03\\x04')", "truncated (ends at byte 1234 of its
    header)", "cannot be read (Permission denied)". `path` is the file at fault (one of a split
    model's parts: then the message names it too)."""

    def __init__(self, path: Path, reason: str) -> None:
        reason = " ".join(reason.split())
        super().__init__(reason)
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ModelFacts:
    architecture: str  # general.architecture ("llama", "qwen2", "clip" for a projector)
    name: str | None  # general.name
    parameters: int  # general.parameter_count, else the tensors' elements added up
    quantization: str  # "Q4_1", "Q4_K_M", "F16" as Ollama names it (from general.file_type)
    file_bytes: int  # all split parts together
    context_length: int | None  # the trained context
    layers: int | None
    head_count: int | None  # the largest, when the file gives one a layer
    kv_heads: int | None  # head_count_kv, else head_count; the largest, when one a layer
    key_length: int | None  # attention.key_length, else embedding_length // head_count
    value_length: int | None
    embedding_length: int | None
    sliding_window: int | None
    chat_template: str | None
    is_projector: bool  # a vision projector (mmproj), loaded beside a model
    weights_bytes: int  # the tensor data of all parts
    family: str  # Ollama's details.family: the architecture
    # One KV head count a layer, when the file gives them so (a hybrid model's recurrent
    # layers have 0); empty when every layer has kv_heads.
    kv_heads_per_layer: tuple[int, ...] = ()

    @property
    def parameter_size(self) -> str:
        """As Ollama shows details.parameter_size: "134.52M", "1.7B", "7.2B", "70B"."""
        return human_number(self.parameters)

    def kv_bytes(self, context: int, cache_type_k: str = "f16",
                 cache_type_v: str = "f16") -> int:
        """The KV cache llama-server allocates for `-c context` (0 without attention facts)."""
        if context < 0:
            raise ValueError(f"context must be 0 or more, not {context}")
        bytes_k, bytes_v = cache_type_bytes(cache_type_k), cache_type_bytes(cache_type_v)
        if self.key_length is None or self.value_length is None:
            return 0
        if self.kv_heads_per_layer:
            heads = sum(self.kv_heads_per_layer)
        elif self.layers is not None and self.kv_heads is not None:
            heads = self.layers * self.kv_heads
        else:
            return 0
        per_token = heads * (self.key_length * bytes_k + self.value_length * bytes_v)
        return math.ceil(context * per_token)

    def estimate_mib(self, context: int, cache_type_k: str = "f16", cache_type_v: str = "f16",
                     projector: ModelFacts | None = None) -> int:
        """MiB (rounded up) for the weights, the KV cache of `-c context` and the projector's
        weights when given; llama-server's compute buffer (tens of MiB) comes on top."""
        total = (self.weights_bytes + self.kv_bytes(context, cache_type_k, cache_type_v)
                 + (projector.weights_bytes if projector is not None else 0))
        return math.ceil(total / MIB)


def cache_type_bytes(cache_type: str) -> Fraction:
    try:
        return CACHE_TYPE_BYTES[cache_type.lower()]
    except KeyError:
        known = ", ".join(CACHE_TYPE_BYTES)
        raise ValueError(f"unknown KV cache type {cache_type!r} (known: {known})") from None


def human_number(count: int) -> str:
    """Ollama's format.HumanNumber, so a model reads the same here as in Ollama's clients."""
    for size, suffix, decimals in ((10**9, "B", 1), (10**6, "M", 2)):
        if count >= size:
            number = count / size
            return f"{number:.{0 if number.is_integer() else decimals}f}{suffix}"
    return f"{count / 1000:.0f}K" if count >= 1000 else str(count)


# -- reading ----------------------------------------------------------------------------------

Signature = tuple[tuple[str, int, int], ...]  # (real path, size, mtime_ns) of each part
_cache: OrderedDict[Signature, ModelFacts] = OrderedDict()
_cache_lock = threading.Lock()


def read_facts(first_part: Path, parts: Sequence[Path] = ()) -> ModelFacts:
    """The facts of a model file (and its other split parts, whose sizes and tensors count
    too). Raises UnreadableModel. Cached by (real path, size, mtime_ns) of every part, so a
    rescan of an unchanged folder reads nothing again."""
    paths = [Path(first_part), *(Path(part) for part in parts)]
    signature = tuple(_signature(path, index) for index, path in enumerate(paths))
    with _cache_lock:
        if (cached := _cache.get(signature)) is not None:
            _cache.move_to_end(signature)
            return cached
    facts = _read(paths, [size for _, size, _ in signature])
    with _cache_lock:
        _cache[signature] = facts
        while len(_cache) > CACHE_ENTRIES:
            _cache.popitem(last=False)
    return facts


def _where(path: Path, index: int) -> str:
    """How a message names the file at fault: a split model's later parts by name."""
    return "" if index == 0 else f"part {path.name}: "


def _signature(path: Path, index: int) -> tuple[str, int, int]:
    try:
        status = os.stat(path)
    except (OSError, ValueError) as error:  # ValueError: a NUL in the path
        raise UnreadableModel(path, f"{_where(path, index)}cannot be read "
                                    f"({getattr(error, 'strerror', None) or error})") from None
    if not stat.S_ISREG(status.st_mode):
        raise UnreadableModel(path, f"{_where(path, index)}not a file")
    return os.path.realpath(path), status.st_size, status.st_mtime_ns


def _read(paths: list[Path], sizes: list[int]) -> ModelFacts:
    readers = [_read_header(path, index) for index, path in enumerate(paths)]
    first = readers[0]
    declared, number = _number(first, "split.count"), _number(first, "split.no")
    if declared is not None and number:  # split.no counts from 0
        raise UnreadableModel(paths[0], f"part {number + 1} of {declared} of a split model, "
                                        f"not its first")
    if (declared or 1) != len(paths):
        raise UnreadableModel(paths[0], f"split in {declared or 1} parts, "
                                        f"{len(paths)} given")
    try:
        return _facts(readers, file_bytes=sum(sizes), path=paths[0])
    except UnicodeDecodeError as error:
        reason = f"corrupt header (text that is not UTF-8: {error.object[:40]!r})"
    except UnreadableModel:
        raise
    except Exception as error:  # values no model has, met as numpy or gguf found them
        reason = f"corrupt header ({type(error).__name__}: {error})"
    raise UnreadableModel(paths[0], reason)


def _read_header(path: Path, index: int) -> GGUFReader:
    """The file's header, or UnreadableModel; the magic is checked first, cheaply, so a file
    that is something else is never mapped."""
    where = _where(path, index)
    try:
        with path.open("rb") as file:
            start = file.read(len(MAGIC))
    except OSError as error:
        raise UnreadableModel(path, f"{where}cannot be read ({error.strerror or error})") from None
    if not start:
        raise UnreadableModel(path, f"{where}empty")
    if start != MAGIC:
        if MAGIC.startswith(start):
            raise UnreadableModel(path, f"{where}truncated (ends at byte {len(start)} of its "
                                        f"header)")
        raise UnreadableModel(path, f"{where}not a GGUF file (starts with {start!r})")
    reader = _open_reader(path)
    if isinstance(reader, str):
        # Raised here, outside the except clause, so the reader's memory map is not kept
        # alive by a traceback that the caller may hold on to.
        raise UnreadableModel(path, where + reader)
    return reader


def _open_reader(path: Path) -> GGUFReader | str:
    """The file's reader, or why GGUFReader could not read it, in one line."""
    try:
        return _HeaderReader(path)
    except _PastTheEnd as past:
        size = past.file_size
        if past.in_tensor_data:
            return (f"truncated (ends at byte {size}, inside its tensor data: a tensor runs to "
                    f"byte {past.needed})")
        return f"truncated (ends at byte {size} of its header)"
    except OSError as error:
        return f"cannot be read ({error.strerror or error})"
    except MemoryError:
        return "cannot be read (out of memory while mapping it)"
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error) as error:
        # gguf's own checks (version, counts, alignment, duplicate names) and whatever numpy
        # raises on values that make no sense.
        detail = error.args[0] if isinstance(error, KeyError) and error.args else error
        return f"corrupt header ({detail})"
    except Exception as error:  # a reader of untrusted files: nothing else may get out
        return f"corrupt header ({type(error).__name__}: {error})"


class _PastTheEnd(Exception):
    def __init__(self, needed: int, file_size: int, in_tensor_data: bool) -> None:
        super().__init__(needed)
        self.needed = needed
        self.file_size = file_size
        self.in_tensor_data = in_tensor_data


class _HeaderReader(GGUFReader):
    """GGUFReader, bounded: reading past the end of the file raises _PastTheEnd, and an array
    longer than KEPT_ARRAY_LENGTH is stepped over instead of being turned into a numpy view an
    element. Both hooks are methods GGUFReader reads the whole header through, the same from
    gguf 0.13 (the first that installs and runs on numpy 2) to 0.19."""

    def _get(self, offset: int, dtype: npt.DTypeLike, count: int = 1,
             override_order: Literal["I", "S", "<"] | None = None) -> npt.NDArray[Any]:
        needed = offset + np.dtype(dtype).itemsize * int(count)
        if needed > self.data.nbytes:
            raise self._past_the_end(needed)
        return super()._get(offset, dtype, count, override_order)

    def _past_the_end(self, needed: int) -> _PastTheEnd:
        # GGUFReader sets data_offset once the header is read, just before the tensor data;
        # a file that ends in the padding between them ends in its header.
        data_offset = vars(self).get("data_offset")
        size = int(self.data.nbytes)
        return _PastTheEnd(needed, size, data_offset is not None and size >= data_offset)

    def _get_field_parts(self, orig_offs: int, raw_type: int
                         ) -> tuple[int, list[npt.NDArray[Any]], list[int], list[GGUFValueType]]:
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, length = self._get(orig_offs, np.uint32), self._get(orig_offs + 4, np.uint64)
        item, count = GGUFValueType(int(item_type[0])), int(length[0])
        size = None if count <= KEPT_ARRAY_LENGTH else self._array_size(orig_offs, item, count)
        if size is None:
            return super()._get_field_parts(orig_offs, raw_type)
        # No element indexes: the field reads as [], its length stays in its parts.
        return ARRAY_HEADER_BYTES + size, [item_type, length], [], [GGUFValueType.ARRAY, item]

    def _array_size(self, orig_offs: int, item: GGUFValueType, count: int) -> int | None:
        """The bytes of an array's elements, stepped over (None: an array of arrays, left to
        GGUFReader)."""
        start = orig_offs + ARRAY_HEADER_BYTES
        scalar = self.gguf_scalar_to_np.get(item)
        if scalar is not None:
            size = np.dtype(scalar).itemsize * count
            if start + size > self.data.nbytes:
                raise self._past_the_end(start + size)
            return size
        if item != GGUFValueType.STRING:
            return None
        swapped = ">" if sys.byteorder == "little" else "<"
        length_at = struct.Struct(("=" if self.byte_order == "I" else swapped) + "Q").unpack_from
        buffer, end, offset = self.data.data, int(self.data.nbytes), start
        # Each string is at least its 8-byte length, so a corrupt count runs out of file soon.
        for _ in range(count):
            if offset + 8 > end:
                raise self._past_the_end(offset + 8)
            offset += 8 + length_at(buffer, offset)[0]
        if offset > end:
            raise self._past_the_end(offset)
        return offset - start


# -- the facts --------------------------------------------------------------------------------

def _value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as Python: a number, a text, or a list of those. Read from the field's
    parts, as every gguf release since 0.13 lays them out (ReaderField.contents() came in 0.16)."""
    field = reader.get_field(key)
    if field is None or not field.types:
        return None
    kind = field.types[-1]

    def element(index: int) -> Any:
        part = field.parts[index]
        if kind == GGUFValueType.STRING:
            return part.tobytes().decode("utf-8")
        return part.tolist()[0]

    if field.types[0] == GGUFValueType.ARRAY:
        return [element(index) for index in field.data]
    return element(field.data[0])


def _number(reader: GGUFReader, key: str) -> int | None:
    value = _value(reader, key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _per_layer(reader: GGUFReader, key: str) -> tuple[int, ...]:
    """A count the file gives one a layer (head_count_kv of a hybrid model), else ()."""
    value = _value(reader, key)
    if isinstance(value, list) and value and all(isinstance(each, int) for each in value):
        return tuple(value)
    return ()


def _count(reader: GGUFReader, key: str) -> int | None:
    """A count given once, or the largest of those given one a layer."""
    per_layer = _per_layer(reader, key)
    return max(per_layer) if per_layer else _number(reader, key)


def _text(reader: GGUFReader, key: str) -> str | None:
    value = _value(reader, key)
    return value if isinstance(value, str) else None


def _quantization(first: GGUFReader, readers: list[GGUFReader]) -> str:
    """general.file_type's name as llama.cpp's quantize writes it ("MOSTLY_Q4_K_M" is
    "Q4_K_M"), else the tensor type that holds the most elements (the norms are many tensors
    but few weights)."""
    file_type = _number(first, "general.file_type")
    try:
        named = LlamaFileType(file_type) if file_type is not None else LlamaFileType.GUESSED
    except ValueError:  # a type newer than this gguf package knows
        named = LlamaFileType.GUESSED
    if named is not LlamaFileType.GUESSED:
        return named.name.removeprefix("MOSTLY_").removeprefix("ALL_")
    elements: Counter[str] = Counter()
    for reader in readers:
        for tensor in reader.tensors:
            elements[tensor.tensor_type.name] += int(tensor.n_elements)
    return elements.most_common(1)[0][0] if elements else "unknown"


def _facts(readers: list[GGUFReader], *, file_bytes: int, path: Path) -> ModelFacts:
    first = readers[0]
    architecture = _text(first, "general.architecture")
    if not architecture:
        raise UnreadableModel(path, "not a model (its header names no general.architecture)")
    tensors = [tensor for reader in readers for tensor in reader.tensors]
    parameters = _number(first, "general.parameter_count")
    if parameters is None:
        parameters = sum(int(tensor.n_elements) for tensor in tensors)
    attention = f"{architecture}.attention"
    head_count = _count(first, f"{attention}.head_count")
    # As llama.cpp reads it: without head_count_kv, every head has its own keys and values.
    kv_key = f"{attention}.head_count_kv"
    if first.get_field(kv_key) is None:
        kv_key = f"{attention}.head_count"
    embedding = _number(first, f"{architecture}.embedding_length")
    head_size = embedding // head_count if embedding and head_count else None
    key_length = _number(first, f"{attention}.key_length") or head_size
    return ModelFacts(
        architecture=architecture,
        name=_text(first, "general.name"),
        parameters=parameters,
        quantization=_quantization(first, readers),
        file_bytes=file_bytes,
        context_length=_number(first, f"{architecture}.context_length"),
        layers=_number(first, f"{architecture}.block_count"),
        head_count=head_count,
        kv_heads=_count(first, kv_key),
        key_length=key_length,
        value_length=_number(first, f"{attention}.value_length") or head_size,
        embedding_length=embedding,
        sliding_window=_number(first, f"{attention}.sliding_window"),
        chat_template=_text(first, "tokenizer.chat_template"),
        is_projector=_text(first, "general.type") == "mmproj" or architecture == "clip",
        weights_bytes=sum(int(tensor.n_bytes) for tensor in tensors),
        family=architecture,
        kv_heads_per_layer=_per_layer(first, kv_key),
    )
