"""The architecture hyper-parameters the forward pass needs, read from an HF ``config.json``.

Llama, Mistral and Qwen2 share one decoder; their differences are flags here (QKV bias, sliding window,
tied embeddings, RoPE scaling), so one model class serves all three.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvpilot.engine.model.rope_config import rope_settings

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


@dataclass(frozen=True)
class ModelArchConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    #: RoPE scaling (``rope_type`` linear/dynamic/llama3/yarn and its keys) or None, read from either
    #: ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (transformers >= 5)
    rope_scaling: dict[str, Any] | None
    #: positions the model serves (dynamic/YaRN scaling extend the config's ``max_position_embeddings``)
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: bias on q/k/v projections (Qwen2: true)
    qkv_bias: bool
    #: bias on the output projection and MLP (rare; some Llama variants)
    o_bias: bool
    mlp_bias: bool
    #: Mistral-style local attention window in tokens, None = full causal attention
    sliding_window: int | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelArchConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise ValueError(f"{path}: no config.json (expected an HF model directory)")
        return cls.from_dict(json.loads(cfg_path.read_text()))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is implemented")
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None  # Qwen2 configs carry a window size but leave it off by default
        attention_bias = bool(cfg.get("attention_bias", model_type == "qwen2"))
        rope_theta, rope_scaling, max_positions = rope_settings(cfg)
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias,
            # Qwen2 has bias on q/k/v only; Llama's attention_bias covers o_proj too
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            sliding_window=int(window) if window else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        from kvpilot.engine.kv.capacity import kv_bytes_per_token

        return kv_bytes_per_token(
            self.num_hidden_layers, self.num_key_value_heads, self.head_dim, dtype_bytes
        )
