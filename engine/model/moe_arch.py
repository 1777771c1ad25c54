"""The Mixture-of-Experts hyper-parameters of an HF ``config.json`` (no torch needed).

Three families route each token to ``top_k`` of ``num_experts`` SwiGLU experts
(docs/architecture.md#mixture-of-experts):

- ``mixtral``: ``num_local_experts`` experts of ``intermediate_size``, every layer sparse; the top-k
  weights renormalised to sum to 1 (softmax over the k chosen logits);
- ``qwen3_moe``: ``num_experts`` (transformers 5 saves ``num_local_experts``) of ``moe_intermediate_size``;
  softmax over all experts, then top-k, renormalised only with ``norm_topk_prob``; layers listed in
  ``mlp_only_layers`` or off the ``decoder_sparse_step`` stride keep a dense MLP of ``intermediate_size``;
- ``qwen2_moe``: as ``qwen3_moe``, plus a shared expert of ``shared_expert_intermediate_size`` every token
  passes through, scaled by ``sigmoid(shared_expert_gate(x))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


@dataclass(frozen=True)
class MoEArch:
    #: routed experts per sparse layer
    num_experts: int
    #: experts each token is sent to (``num_experts_per_tok``)
    top_k: int
    #: hidden size of one routed expert's SwiGLU
    intermediate_size: int
    #: divide the chosen k routing weights by their sum (Mixtral always; Qwen: ``norm_topk_prob``)
    renormalize: bool
    #: per layer: True = sparse MoE block, False = the dense MLP of the model's ``intermediate_size``
    sparse_layers: tuple[bool, ...]
    #: hidden size of the always-on shared expert (Qwen2-MoE), 0 = none
    shared_expert_intermediate_size: int
    #: checkpoint naming: ``mixtral`` (block_sparse_moe.experts.N.w1/w2/w3) or ``qwen``
    #: (mlp.experts.N.gate_proj/up_proj/down_proj)
    naming: str


def moe_settings(cfg: dict[str, Any], model_type: str, num_layers: int) -> MoEArch | None:
    """The MoE parameters of a ``model_type`` in ``MOE_MODEL_TYPES``, or None for a dense model."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts <= 0 or not 0 < top_k <= experts:
        raise ValueError(f"{model_type}: num_experts_per_tok ({top_k}) must be in 1..num_experts ({experts})")
    if model_type == "mixtral":
        return MoEArch(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=int(cfg["intermediate_size"]),
            renormalize=True,
            sparse_layers=(True,) * num_layers,
            shared_expert_intermediate_size=0,
            naming="mixtral",
        )
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or ()}
    return MoEArch(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=int(cfg["moe_intermediate_size"]),
        renormalize=bool(cfg.get("norm_topk_prob", False)),  # HF default for both
        # HF's rule (Qwen2MoeDecoderLayer): sparse unless listed dense or off the stride
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
        shared_expert_intermediate_size=(
            int(cfg.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        ),
        naming="qwen",
    )


#: the dense family whose attention each MoE family shares (``families.family_traits`` reads it)
MOE_BASE_FAMILY = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3"}


def dense_view(cfg: dict[str, Any], model_type: str) -> tuple[dict[str, Any], str]:
    """(config, family) for reading an MoE model's attention and norms as its dense base family's:
    Qwen2-MoE names its q/k/v bias ``qkv_bias`` where Qwen2 says ``attention_bias``."""
    base = MOE_BASE_FAMILY.get(model_type)
    if base is None:
        return cfg, model_type
    if model_type == "qwen2_moe" and "attention_bias" not in cfg:
        cfg = {**cfg, "attention_bias": bool(cfg.get("qkv_bias", True))}
    return cfg, base
