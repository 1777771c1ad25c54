"""The architecture hyper-parameters the forward pass needs, read from an HF ``config.json``.

The dense families (Llama 3.x, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text) and the MoE ones
(``moe_arch``) share one decoder; their differences are fields here (``families`` reads them per family),
so one model class serves all of them. docs/models.md lists what each family needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpilot.engine.model.families import DENSE_MODEL_TYPES, family_traits
from kvpilot.engine.model.moe_arch import MOE_MODEL_TYPES, MoEArch, dense_view, moe_settings
from kvpilot.engine.model.rope_config import rope_settings, rotary_dim

#: vision-language checkpoints whose text model is served (``text_config``; the vision tower is not loaded)
MULTIMODAL_TEXT_TYPES = {"gemma3": "gemma3_text"}
SUPPORTED_MODEL_TYPES = (*DENSE_MODEL_TYPES, *MOE_MODEL_TYPES, *MULTIMODAL_TEXT_TYPES)

RopeSpec = tuple[float, dict[str, Any] | None]


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
    #: RoPE base of the global ("full_attention") layers
    rope_theta: float
    #: RoPE scaling (``rope_type`` linear/dynamic/llama3/yarn/longrope and its keys) or None, read from
    #: either ``rope_scaling`` (transformers < 5) or ``rope_parameters`` (transformers >= 5)
    rope_scaling: dict[str, Any] | None
    #: positions the model serves (dynamic/YaRN scaling extend the config's ``max_position_embeddings``)
    max_position_embeddings: int
    tie_word_embeddings: bool
    #: bias on q/k/v projections (Qwen2: true)
    qkv_bias: bool
    #: bias on the output projection and MLP (rare; some Llama variants)
    o_bias: bool
    mlp_bias: bool
    #: per layer: the local attention window in tokens, None = full causal attention
    layer_windows: tuple[int | None, ...]
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    #: the gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)
    hidden_act: str = "silu"
    #: RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    qk_norm: bool = False
    #: Gemma's norms: RMSNorm scaled by (1 + w), a norm after each sublayer too (``post_attention_layernorm``
    #: on the attention output, ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` around the
    #: MLP), embeddings times √hidden
    gemma_norms: bool = False
    #: attention scale = query_pre_attn_scalar ** -0.5 (Gemma); None = head_dim ** -0.5
    query_pre_attn_scalar: float | None = None
    #: attention logits become cap * tanh(logits / cap) before the softmax (Gemma 2), None = off
    attn_logit_softcap: float | None = None
    #: the LM head's logits become cap * tanh(logits / cap) (Gemma 2), None = off
    final_logit_softcap: float | None = None
    #: RoPE (theta, scaling) of the sliding-window layers when it differs from the global one (Gemma 3)
    local_rope: RopeSpec | None = None
    #: the checkpoint stores q/k/v as one ``qkv_proj`` and gate/up as one ``gate_up_proj`` (Phi-3)
    fused_checkpoint: bool = False
    #: routed experts (Mixtral, Qwen-MoE; docs/architecture.md#mixture-of-experts), None = dense
    moe: MoEArch | None = None
    #: the text model of a vision-language checkpoint (``gemma3``): its weights sit under
    #: ``language_model.``, the vision tower's are not loaded and images are not accepted
    text_only: bool = False
    #: dims of each head RoPE rotates (``head_dim`` x ``partial_rotary_factor``; Phi-4-mini 3/4), 0 = all
    partial_rotary_dim: int = 0

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def sliding_window(self) -> int | None:
        """The window every layer shares (Mistral, Phi-3), None when some layer attends globally."""
        windows = set(self.layer_windows)
        return windows.pop() if len(windows) == 1 else None

    @property
    def rotary_dim(self) -> int:
        """Dims of each head RoPE rotates (the first ones; the rest pass through)."""
        return self.partial_rotary_dim or self.head_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def layer_rope(self, layer: int) -> RopeSpec:
        """(theta, scaling) of ``layer``'s rotary embedding."""
        if self.local_rope is not None and self.layer_windows[layer] is not None:
            return self.local_rope
        return self.rope_theta, self.rope_scaling

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
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                "(docs/models.md)"
            )
        if model_type in MULTIMODAL_TEXT_TYPES:
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ValueError(f"a {model_type!r} config needs its language model's text_config")
            shared: dict[str, Any] = {
                k: cfg[k] for k in ("bos_token_id", "eos_token_id", "tie_word_embeddings") if k in cfg
            }
            inner = cls.from_dict({**shared, **text, "model_type": MULTIMODAL_TEXT_TYPES[model_type]})
            return replace(inner, model_type=model_type, text_only=True)
        heads = int(cfg["num_attention_heads"])
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        hidden = int(cfg["hidden_size"])
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        layers = int(cfg["num_hidden_layers"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        traits = family_traits(*dense_view(cfg, model_type), layers)  # an MoE family: its dense base's
        per_type = _rope_per_layer_type(cfg, model_type, traits.layer_types)
        rope_theta, rope_scaling, max_positions = (
            per_type.get("full_attention") or per_type["sliding_attention"]
        )
        local = per_type.get("sliding_attention")
        local_rope = None if local is None or local[:2] == (rope_theta, rope_scaling) else local[:2]
        if local is not None:
            max_positions = min(max_positions, local[2]) if "full_attention" in per_type else local[2]
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=traits.tie_word_embeddings,
            qkv_bias=traits.qkv_bias,
            o_bias=traits.o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            layer_windows=tuple(
                traits.window if t == "sliding_attention" else None for t in traits.layer_types
            ),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=traits.hidden_act,
            qk_norm=traits.qk_norm,
            gemma_norms=traits.gemma_norms,
            query_pre_attn_scalar=traits.query_pre_attn_scalar,
            attn_logit_softcap=traits.attn_logit_softcap,
            final_logit_softcap=traits.final_logit_softcap,
            local_rope=local_rope,
            fused_checkpoint=traits.fused_checkpoint,
            moe=moe_settings(cfg, model_type, layers),
            partial_rotary_dim=0 if rotary_dim(cfg, head_dim) == head_dim else rotary_dim(cfg, head_dim),
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        from kvpilot.engine.kv.capacity import kv_bytes_per_token

        return kv_bytes_per_token(
            self.num_hidden_layers, self.num_key_value_heads, self.head_dim, dtype_bytes
        )


def _rope_per_layer_type(
    cfg: dict[str, Any], model_type: str, layer_types: tuple[str, ...]
) -> dict[str, tuple[float, dict[str, Any] | None, int]]:
    """``rope_settings`` for each layer type the model has; one reading when its layers all rotate alike."""
    if model_type == "gemma3_text" and "rope_parameters" not in cfg:
        # Gemma3TextConfig's default bases: global 1e6, local 1e4
        cfg = {"rope_theta": 1e6, "rope_local_base_freq": 1e4, **cfg}
    params = cfg.get("rope_parameters")
    nested = isinstance(params, dict) and any(isinstance(v, dict) for v in params.values())
    if not nested and "rope_local_base_freq" not in cfg:
        shared = rope_settings(cfg)
        return {t: shared for t in set(layer_types)}
    return {t: rope_settings(cfg, t) for t in set(layer_types)}
