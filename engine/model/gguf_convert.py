"""Convert a llama-architecture GGUF file into a Hugging Face model directory (float32 safetensors).

The result is what ``transformers.LlamaForCausalLM.from_pretrained`` reads: config.json,
model.safetensors (or shards plus an index), generation_config.json, tokenizer.json and
tokenizer_config.json (with the GGUF's chat template).

Two things llama.cpp changed on the way in are undone here:
- tensor names (``blk.N.attn_q`` → ``model.layers.N.self_attn.q_proj``, …);
- the row order of q_proj/k_proj: llama.cpp's convert_hf_to_gguf.py interleaves each head's two rotary
  halves (``w.reshape(n_head, 2, d//2, ...).swapaxes(1, 2)``) because its RoPE rotates adjacent pairs while
  HF rotates halves. :func:`unpermute_rope_rows` applies the inverse.

Quantized tensors (Q4_1, Q8_0, …) are dequantized with ``gguf.quants.dequantize``; their values are exactly
representable in float32, so nothing is lost relative to the GGUF.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, ReaderTensor
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tqdm import tqdm

from kvpilot.engine.model.gguf_tokenizer import tokenizer_files_from_gguf

# Part of the conversion cache key: bump whenever the files this module writes would change.
CONVERTER_VERSION = 1
# Shards bound the converter's peak memory to one shard of float32 tensors, not the whole model.
DEFAULT_MAX_SHARD_BYTES = 2 * 1024**3

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"^([a-z_]+)\.(weight|bias)$")


def hf_tensor_name(gguf_name: str) -> str:
    """The HF Llama parameter name for a llama.cpp tensor name."""
    layer = _LAYER_NAME.match(gguf_name)
    if layer and layer.group(2) in _LAYER_TENSORS:
        return f"model.layers.{layer.group(1)}.{_LAYER_TENSORS[layer.group(2)]}.{layer.group(3)}"
    other = _GLOBAL_NAME.match(gguf_name)
    if other and other.group(1) in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[other.group(1)]}.{other.group(2)}"
    if gguf_name == "rope_freqs.weight":
        raise ValueError(
            "GGUF has a rope_freqs tensor (Llama-3.1-style RoPE scaling); converting it is not supported"
        )
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama equivalent; is this a llama-architecture file?")


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


def llama_config(metadata: Mapping[str, Any], tensor_names: set[str], vocab_rows: int) -> dict[str, Any]:
    """config.json for the model a llama-architecture GGUF describes."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama' can be converted")

    def required(key: str) -> Any:
        if f"llama.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks llama.{key}, which config.json needs")
        return metadata[f"llama.{key}"]

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = int(metadata.get("llama.attention.head_count_kv", heads))
    head_dim = int(metadata.get("llama.attention.key_length", hidden // heads))
    if int(metadata.get("llama.attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF has different key and value head sizes; Llama needs them equal")
    if int(metadata.get("llama.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF applies RoPE to part of each head only; Llama rotates the whole head")
    if heads % kv_heads:
        raise ValueError(f"GGUF head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    vocab = int(metadata.get("llama.vocab_size", vocab_rows))
    if vocab != vocab_rows:
        raise ValueError(f"GGUF llama.vocab_size={vocab} but token_embd has {vocab_rows} rows")
    context = int(required("context_length"))
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(required("feed_forward_length")),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _float32_value(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32_value(metadata.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata),
        "max_position_embeddings": context,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "torch_dtype": "float32",
    }


def generation_config(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """generation_config.json: every end-of-generation id llama.cpp knows (eos, end-of-turn,
    end-of-message)."""
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is not None and int(value) not in eos_ids:
            eos_ids.append(int(value))
    config: dict[str, Any] = {}
    if metadata.get("tokenizer.ggml.bos_token_id") is not None:
        config["bos_token_id"] = int(metadata["tokenizer.ggml.bos_token_id"])
    if eos_ids:
        config["eos_token_id"] = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    if metadata.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = int(metadata["tokenizer.ggml.padding_token_id"])
    return config


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
    config = llama_config(metadata, set(tensors), vocab_rows=int(tensors["token_embd.weight"].shape[-1]))
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
                hf_name = hf_tensor_name(tensor.name)
                arrays[hf_name] = _float32_hf_tensor(tensor, config)
                weight_map[hf_name] = file_name
                total_bytes += arrays[hf_name].nbytes
                bar.update(1)
            save_file(arrays, str(out_dir / file_name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(out_dir / "model.safetensors.index.json", index)


def _float32_hf_tensor(tensor: ReaderTensor, config: Mapping[str, Any]) -> np.ndarray:
    # dequantize() also widens F16/BF16 and passes F32 through; it returns the HF (row-major) shape.
    weight = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    if ".attn_q." in tensor.name:
        weight = unpermute_rope_rows(weight, config["num_attention_heads"])
    elif ".attn_k." in tensor.name:
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
    expected = {"token_embd.weight", "output_norm.weight"}
    for layer in range(config["num_hidden_layers"]):
        expected.update(f"blk.{layer}.{part}.weight" for part in _LAYER_TENSORS)
    missing = sorted(expected - tensor_names)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ValueError(f"GGUF is missing tensors a Llama model needs: {shown}")


def _rope_scaling(metadata: Mapping[str, Any]) -> dict[str, Any] | None:
    kind = metadata.get("llama.rope.scaling.type")
    factor = metadata.get("llama.rope.scaling.factor", metadata.get("llama.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # older files only carry rope.scale_linear
    if kind in (None, "none"):
        return None
    if factor is None:
        raise ValueError(f"GGUF RoPE scaling {kind!r} has no llama.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32_value(factor)}
    if kind == "yarn":
        original = metadata.get("llama.rope.scaling.original_context_length")
        if original is None:
            raise ValueError("GGUF YaRN RoPE scaling lacks llama.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": _float32_value(factor),
            "original_max_position_embeddings": int(original),
        }
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported; supported: linear, yarn")


def _float32_value(value: float) -> float:
    # GGUF stores float32; its shortest decimal form (1e-05, not 9.999999747378752e-06) is what HF configs
    # hold, and it rounds back to the same float32, so the model computes identically.
    return float(str(np.float32(value)))


def _write_json(path: Path, document: Mapping[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
