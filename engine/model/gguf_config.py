"""config.json and generation_config.json from a GGUF's metadata (no torch needed).

Architectures whose llama.cpp tensor names and metadata keys are the standard ones convert:
``llama``, ``qwen2`` (q/k/v biases) and ``qwen3`` (``attn_q_norm`` / ``attn_k_norm``), ``phi3`` and
``gemma2`` / ``gemma3`` (their keys: ``gguf_families``), and the MoE ones: ``llama`` with
``expert_count`` (Mixtral), ``qwen2moe`` (with a shared expert) and ``qwen3moe``, whose experts llama.cpp
stacks into ``ffn_{gate,up,down}_exps`` beside the router ``ffn_gate_inp``. Metadata keys are prefixed
with the architecture (``qwen3.embedding_length``). llama.cpp permutes Q/K rows only for ``llama`` (its
RoPE rotates adjacent pairs there; the others' GGUFs keep HF's rotate-half layout,
``PERMUTED_ROPE_ARCHS``). docs/models.md#gguf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpilot.engine.model.gguf_families import family_config, float_value

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
#: the HF model type of each GGUF architecture whose name differs (``llama`` with experts: ``mixtral``)
_MODEL_TYPES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}
_MOE_ARCHS = ("qwen2moe", "qwen3moe")
#: model types whose q/k rows llama.cpp's converter interleaved (undone on the way in): Mixtral's GGUFs
#: are ``llama`` files
PERMUTED_ROPE_ARCHS = ("llama", "mixtral")


def hf_config(
    metadata: Mapping[str, Any],
    tensor_names: set[str],
    vocab_rows: int,
    rope_factors: Mapping[str, list[float]] | None = None,
) -> dict[str, Any]:
    """config.json for the model a GGUF of one of ``GGUF_ARCHITECTURES`` describes; ``rope_factors`` are
    the values of Phi-3's LongRoPE factor tensors (``long_factor`` / ``short_factor``), if it has them."""
    arch = metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def required(key: str) -> Any:
        if f"{arch}.{key}" not in metadata:
            raise ValueError(f"GGUF metadata lacks {arch}.{key}, which config.json needs")
        return metadata[f"{arch}.{key}"]

    hidden = int(required("embedding_length"))
    heads = int(required("attention.head_count"))
    kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv", heads))
    head_dim = int(metadata.get(f"{arch}.attention.key_length", hidden // heads))
    if int(metadata.get(f"{arch}.attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF has different key and value head sizes; the decoder needs them equal")
    if arch != "phi3" and int(metadata.get(f"{arch}.rope.dimension_count", head_dim)) != head_dim:
        raise ValueError("GGUF applies RoPE to part of each head only; the decoder rotates the whole head")
    if heads % kv_heads:
        raise ValueError(f"GGUF head_count {heads} is not a multiple of head_count_kv {kv_heads}")
    vocab = int(metadata.get(f"{arch}.vocab_size", vocab_rows))
    if vocab != vocab_rows:
        raise ValueError(f"GGUF {arch}.vocab_size={vocab} but token_embd has {vocab_rows} rows")
    context = int(required("context_length"))
    bos, eos = metadata.get("tokenizer.ggml.bos_token_id"), metadata.get("tokenizer.ggml.eos_token_id")
    experts = int(metadata.get(f"{arch}.expert_count") or 0)
    model_type = _MODEL_TYPES.get(arch, "mixtral" if arch == "llama" and experts else arch)
    architecture = "MixtralForCausalLM" if model_type == "mixtral" else GGUF_ARCHITECTURES[arch]
    moe: dict[str, Any] = {}
    if experts:
        moe["num_experts_per_tok"] = int(required("expert_used_count"))
        if model_type == "mixtral":
            moe["num_local_experts"] = experts
        else:  # llama.cpp renormalises qwen3moe's top-k weights, never qwen2moe's; every layer is sparse
            ff = int(required("expert_feed_forward_length"))
            moe.update(num_experts=experts, moe_intermediate_size=ff, norm_topk_prob=arch == "qwen3moe")
            moe.update(decoder_sparse_step=1, mlp_only_layers=[])
        if arch == "qwen2moe":  # llama.cpp's fallback for the shared expert's size: feed_forward_length
            shared = metadata.get(f"{arch}.expert_shared_feed_forward_length")
            moe["shared_expert_intermediate_size"] = int(
                shared if shared is not None else required("feed_forward_length")
            )
    elif arch in _MOE_ARCHS:
        raise ValueError(f"GGUF architecture {arch} has no {arch}.expert_count")
    ff_default = moe.get("moe_intermediate_size")
    intermediate = metadata.get(f"{arch}.feed_forward_length", ff_default)
    if intermediate is None:
        raise ValueError(f"GGUF metadata lacks {arch}.feed_forward_length, which config.json needs")
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        **moe,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(intermediate),
        "num_hidden_layers": int(required("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": float_value(required("attention.layer_norm_rms_epsilon")),
        "rope_theta": float_value(metadata.get(f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(metadata, arch),
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
    config.update(family_config(arch, metadata, head_dim, rope_factors or {}))
    return config


def llama_config(metadata: Mapping[str, Any], tensor_names: set[str], vocab_rows: int) -> dict[str, Any]:
    """``hf_config`` (the name the llama-only converter had)."""
    return hf_config(metadata, tensor_names, vocab_rows)


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


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> dict[str, Any] | None:
    kind = metadata.get(f"{arch}.rope.scaling.type")
    factor = metadata.get(f"{arch}.rope.scaling.factor", metadata.get(f"{arch}.rope.scale_linear"))
    if kind is None and factor is not None:
        kind = "linear"  # older files only carry rope.scale_linear
    if kind in (None, "none"):
        return None
    if factor is None:
        raise ValueError(f"GGUF RoPE scaling {kind!r} has no {arch}.rope.scaling.factor")
    if kind == "linear":
        return {"rope_type": "linear", "factor": float_value(factor)}
    if kind == "yarn":
        original = metadata.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ValueError(f"GGUF YaRN RoPE scaling lacks {arch}.rope.scaling.original_context_length")
        return {
            "rope_type": "yarn",
            "factor": float_value(factor),
            "original_max_position_embeddings": int(original),
        }
    raise ValueError(f"GGUF RoPE scaling {kind!r} is not supported; supported: linear, yarn")
