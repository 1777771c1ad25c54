"""Convert a GGUF file (``gguf_config.GGUF_ARCHITECTURES``: llama, Mixtral, Qwen2, Qwen3, Qwen2-MoE,
Qwen3-MoE, Phi-3, Gemma 2, Gemma 3) into a Hugging Face model directory (float32 safetensors).

The result is what transformers' ``from_pretrained`` of the family's class reads: config.json
(``gguf_config``), model.safetensors (or shards plus an index), generation_config.json, tokenizer.json and
tokenizer_config.json (with the GGUF's chat template).

What llama.cpp changed on the way in is undone here:
- tensor names and layouts (``gguf_names``: ``blk.N.attn_q`` → ``model.layers.N.self_attn.q_proj``, the
  stacked experts split back into one tensor per expert, Gemma's norms less the unit offset llama.cpp
  added);
- for ``llama`` only, the row order of q_proj/k_proj: llama.cpp's convert_hf_to_gguf.py interleaves each
  head's two rotary halves (``w.reshape(n_head, 2, d//2, ...).swapaxes(1, 2)``) because its RoPE rotates
  adjacent pairs while HF rotates halves. :func:`unpermute_rope_rows` applies the inverse.

Quantized tensors (Q4_1, Q8_0, …) are dequantized with ``gguf.quants.dequantize``; their values are exactly
representable in float32, so nothing is lost relative to the GGUF.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from kvpilot.engine.model.gguf_config import PERMUTED_ROPE_ARCHS, generation_config, hf_config, llama_config
from kvpilot.engine.model.gguf_families import float_value
from kvpilot.engine.model.gguf_names import ROPE_FACTOR_TENSORS, hf_tensor_name, hf_tensors, required_tensors
from kvpilot.engine.model.gguf_tokenizer import tokenizer_files_from_gguf

__all__ = ["convert_gguf", "convert_gguf_tokenizer", "hf_tensor_name", "llama_config", "unpermute_rope_rows"]

# Part of the conversion cache key: bump whenever the files this module writes would change.
CONVERTER_VERSION = 1
# Shards bound the converter's peak memory to one shard of float32 tensors, not the whole model.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3


def unpermute_rope_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (rows are output features; a bias is a 1-D weight)."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"cannot un-permute {rows} rows into {n_head} heads of two rotary halves")
    half = rows // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def read_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata of a GGUF as Python values (the GGUF.* header fields left out)."""
    return {name: field.contents() for name, field in reader.fields.items() if not name.startswith("GGUF.")}


def _open_gguf(gguf_path: Path) -> GGUFReader:
    try:
        return GGUFReader(gguf_path, "r")
    except (ValueError, OSError) as error:
        raise ValueError(f"{gguf_path} is not a readable GGUF file: {error}") from None


def _write_metadata_files(reader: GGUFReader, gguf_path: Path, out_dir: Path) -> tuple[dict[str, Any], dict]:
    """config.json, generation_config.json and the tokenizer files; returns (config, tensors by name)."""
    metadata = read_metadata(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"{gguf_path} has no token_embd.weight tensor")
    factors = {
        key: [float_value(f) for f in _float32(tensors[name])]
        for key, name in ROPE_FACTOR_TENSORS.items()
        if name in tensors
    }
    rows = int(tensors["token_embd.weight"].shape[-1])
    config = hf_config(metadata, set(tensors), vocab_rows=rows, rope_factors=factors)
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", generation_config(metadata))
    tokenizer_files_from_gguf(metadata, model_max_length=config["max_position_embeddings"]).write(out_dir)
    return config, tensors


def convert_gguf(
    gguf_path: Path, out_dir: Path, progress: bool = True, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES
) -> None:
    """Write the HF-format directory for ``gguf_path`` into the existing, empty ``out_dir``."""
    config, tensors = _write_metadata_files(_open_gguf(gguf_path), gguf_path, out_dir)
    _check_complete(set(tensors), config)
    _write_weights(list(tensors.values()), config, out_dir, progress, max_shard_bytes, gguf_path.name)


def convert_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Only the tokenizer (and config) of ``gguf_path``: what a router needs, without dequantizing weights."""
    _write_metadata_files(_open_gguf(gguf_path), gguf_path, out_dir)


def _write_weights(
    tensors: list[ReaderTensor],
    config: Mapping[str, Any],
    out_dir: Path,
    progress: bool,
    max_shard_bytes: int,
    label: str,
) -> None:
    shards = list(_plan_shards(tensors, max_shard_bytes))
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map: dict[str, str] = {}
    total_bytes = 0
    with tqdm(total=len(tensors), desc=f"Converting {label}", unit="tensor", disable=not progress) as bar:
        for shard, file_name in zip(shards, names, strict=True):
            arrays: dict[str, np.ndarray] = {}
            for tensor in shard:
                for hf_name, array in hf_tensors(tensor.name, _float32_hf_tensor(tensor, config), config):
                    arrays[hf_name] = array
                    weight_map[hf_name] = file_name
                    total_bytes += array.nbytes
                bar.update(1)
            save_file(arrays, str(out_dir / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / "model.safetensors.index.json", index)


def _float32(tensor: ReaderTensor) -> np.ndarray:
    # dequantize() also widens F16/BF16 and passes F32 through; it returns the HF (row-major) shape.
    return np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)


def _float32_hf_tensor(tensor: ReaderTensor, config: Mapping[str, Any]) -> np.ndarray:
    weight = _float32(tensor)
    permuted = config["model_type"] in PERMUTED_ROPE_ARCHS
    if permuted and ".attn_q." in tensor.name:
        weight = unpermute_rope_rows(weight, config["num_attention_heads"])
    elif permuted and ".attn_k." in tensor.name:
        weight = unpermute_rope_rows(weight, config["num_key_value_heads"])
    return np.ascontiguousarray(weight)


def _plan_shards(tensors: list[ReaderTensor], max_shard_bytes: int) -> Iterator[list[ReaderTensor]]:
    shard: list[ReaderTensor] = []
    shard_bytes = 0
    for tensor in tensors:
        size = int(tensor.n_elements) * 4
        if shard and shard_bytes + size > max_shard_bytes:
            yield shard
            shard, shard_bytes = [], 0
        shard.append(tensor)
        shard_bytes += size
    if shard:
        yield shard


def _check_complete(tensor_names: set[str], config: Mapping[str, Any]) -> None:
    missing = sorted(required_tensors(config) - tensor_names)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        family = "a Llama" if config["model_type"] == "llama" else f"a {config['model_type']}"
        raise ValueError(f"GGUF is missing tensors {family} model needs: {shown}")


def _write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
