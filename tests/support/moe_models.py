"""Tiny seeded MoE models saved by transformers' own classes (Mixtral, Qwen3-MoE, Qwen2-MoE) and HF eager's
greedy tokens on them: shared by the MoE model tests and the MoE GGUF tests. Importable because
``tests/conftest.py`` puts this folder on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

import torch
from hf_families import hf_reference
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from kvpilot.engine.model.tiny import write_tiny_llama

VOCAB, STEPS = 320, 32
PROMPT = [(37 * i + 11) % 300 + 5 for i in range(24)]
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    # wider than HF's 0.02 default: decisive routers and logits, so 1e-6 float noise flips no expert
    "initializer_range": 0.15,
    "bos_token_id": 1,
    "eos_token_id": 0,
    "tie_word_embeddings": False,
}
FAMILIES = {
    "mixtral": (
        MixtralConfig,
        MixtralForCausalLM,
        {"intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "head_dim": 16,
        },
    ),
    "qwen2_moe": (
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        {
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "mlp_only_layers": [1],  # layer 1 keeps a dense MLP
        },
    ),
}


def write_moe_model(directory: Path, family: str, seed: int = 0, **overrides: object) -> Path:
    """``family``'s tiny model (``FAMILIES``, with config ``overrides``) saved by transformers into
    ``directory``, with the tiny tokenizer."""
    write_tiny_llama(directory, seed=seed, vocab_size=VOCAB)  # for its tokenizer files
    (directory / "model.safetensors").unlink()
    (directory / "config.json").unlink()
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    model_cls(config_cls(**COMMON, **{**extra, **overrides})).save_pretrained(directory)
    return directory


def hf_greedy(directory: Path, family: str) -> tuple[list[int], list[float]]:
    """HF eager (attention and experts) with its own KV cache: argmax and its logprob each step."""
    model_cls = FAMILIES[family][1]
    hf = model_cls.from_pretrained(
        directory, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    return hf_reference(hf, PROMPT, STEPS)
