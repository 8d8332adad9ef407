"""Small real GGUF files, written with gguf's own GGUFWriter (the llama.cpp project's): a model
with the metadata llama.cpp's converters write, split in parts as gguf-split splits one, and a
vision projector. The tensors are few and tiny, of roughly the right shapes; the metadata is what
the tests read back. A file is a few KB."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter, LlamaFileType
from gguf.quants import quant_shape_to_byte_shape

Q4_1 = GGMLQuantizationType.Q4_1
EMBEDDING_ROWS = 32  # token_embd's rows, whatever the vocabulary: its size is not read


def write_model(path: Path, *, arch: str = "llama", name: str | None = "tiny",
                context: int = 2048, layers: int = 2, heads: int = 4,
                kv_heads: int | Sequence[int] | None = 2, embedding: int = 64,
                template: str | None = None,
                file_type: int | None = LlamaFileType.MOSTLY_Q4_1,
                parameter_count: int | None = None, tensor_type: GGMLQuantizationType = Q4_1,
                split: int = 1, vocabulary: int = 32, key_length: int | None = None,
                value_length: int | None = None, sliding_window: int | None = None) -> list[Path]:
    """A model of `layers` attention layers; its parts' paths (one unless `split` > 1, then
    `stem-00001-of-0000N.gguf`, ... as gguf-split names them, the first with every key and all
    of them with split.no, split.count and split.tensors.count). `kv_heads` may be one count a
    layer (0 for a hybrid model's recurrent layers) or None (no head_count_kv key);
    `file_type` None writes no general.file_type; `vocabulary` tokens go into the tokenizer's
    arrays (tokens, types and scores)."""
    tensors = model_tensors(layers=layers, heads=heads, kv_heads=kv_heads, embedding=embedding,
                            key_length=key_length, value_length=value_length)
    per_part = math.ceil(len(tensors) / split)
    if math.ceil(len(tensors) / per_part) != split:
        raise ValueError(f"{len(tensors)} tensors do not make {split} parts; change `layers`")
    writer = GGUFWriter(path, arch, split_max_tensors=per_part if split > 1 else 0)
    if name is not None:
        writer.add_name(name)
    writer.add_type("model")
    writer.add_context_length(context)
    writer.add_block_count(layers)
    writer.add_embedding_length(embedding)
    writer.add_head_count(heads)
    if kv_heads is not None:
        writer.add_head_count_kv(kv_heads if isinstance(kv_heads, int) else list(kv_heads))
    if key_length is not None:
        writer.add_key_length(key_length)
    if value_length is not None:
        writer.add_value_length(value_length)
    if sliding_window is not None:
        writer.add_sliding_window(sliding_window)
    if file_type is not None:
        writer.add_file_type(int(file_type))
    if parameter_count is not None:
        writer.add_uint64("general.parameter_count", parameter_count)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"token{index}" for index in range(vocabulary)])
    writer.add_token_types([1] * vocabulary)
    writer.add_token_scores([0.0] * vocabulary)
    if template is not None:
        writer.add_chat_template(template)
    for tensor_name, rows, columns, kind in tensors:
        add_tensor(writer, tensor_name, rows, columns, kind if kind else tensor_type)
    return finish(writer, Path(path))


def model_tensors(*, layers: int, heads: int, kv_heads: int | Sequence[int] | None,
                  embedding: int, key_length: int | None, value_length: int | None
                  ) -> list[tuple[str, int, int, GGMLQuantizationType | None]]:
    """(name, rows, columns, type: None for the model's own) of a llama-like model's tensors:
    the norms in F32, as converters write them."""
    head_k = key_length or embedding // heads
    head_v = value_length or embedding // heads
    f32 = GGMLQuantizationType.F32
    tensors: list[tuple[str, int, int, GGMLQuantizationType | None]] = [
        ("token_embd.weight", EMBEDDING_ROWS, embedding, None),
        ("output_norm.weight", 1, embedding, f32),
    ]
    for layer in range(layers):
        kv = (heads if kv_heads is None else
              kv_heads if isinstance(kv_heads, int) else kv_heads[layer])
        block = f"blk.{layer}"
        tensors += [(f"{block}.attn_norm.weight", 1, embedding, f32),
                    (f"{block}.attn_q.weight", heads * head_k, embedding, None),
                    (f"{block}.attn_output.weight", embedding, heads * head_v, None)]
        if kv:  # a recurrent layer has no keys and values
            tensors += [(f"{block}.attn_k.weight", kv * head_k, embedding, None),
                        (f"{block}.attn_v.weight", kv * head_v, embedding, None)]
    return tensors


def add_tensor(writer: GGUFWriter, name: str, rows: int, columns: int,
               kind: GGMLQuantizationType) -> None:
    """A zeroed tensor; a row is widened to a whole number of the type's blocks."""
    block, _ = GGML_QUANT_SIZES[kind]
    columns = math.ceil(columns / block) * block
    if kind in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
        dtype = np.float32 if kind == GGMLQuantizationType.F32 else np.float16
        shape: tuple[int, ...] = (columns,) if rows == 1 else (rows, columns)
        writer.add_tensor(name, np.zeros(shape, dtype=dtype))
        return
    data = np.zeros(quant_shape_to_byte_shape((rows, columns), kind), dtype=np.uint8)
    writer.add_tensor(name, data, raw_dtype=kind)


def finish(writer: GGUFWriter, path: Path) -> list[Path]:
    parts = writer.format_shard_names(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return parts


def write_projector(path: Path, *, name: str = "tiny") -> Path:
    """A vision projector (mmproj) as llama.cpp's converter writes one: architecture "clip",
    general.type "mmproj", F16 tensors."""
    writer = GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    writer.add_name(name)
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_uint32("clip.vision.embedding_length", 64)
    writer.add_uint32("clip.vision.block_count", 1)
    writer.add_uint32("clip.vision.attention.head_count", 4)
    f16 = GGMLQuantizationType.F16
    for tensor_name, rows, columns in (("v.patch_embd.weight", 64, 48),
                                       ("v.blk.0.attn_q.weight", 64, 64),
                                       ("mm.0.weight", 64, 64)):
        add_tensor(writer, tensor_name, rows, columns, f16)
    return finish(writer, Path(path))[0]
