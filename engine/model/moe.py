"""The sparse Mixture-of-Experts block that replaces a decoder layer's MLP (Mixtral, Qwen2-MoE, Qwen3-MoE;
docs/architecture.md#mixture-of-experts).

The router is a plain ``[E, H]`` weight, not an ``nn.Linear``: int8 quantization and oneDNN packing
replace ``nn.Linear`` layers, and a rounded router would choose other experts than the checkpoint's
(vLLM keeps the gate unquantized too). The experts are stacked ``w13`` ``[E, 2I, H]`` / ``w2`` ``[E, H, I]``
and run by ``kernel``: ``sorted`` (``moe_experts.sorted_moe``, the CPU path, also correct on a GPU) or
``triton`` (``fused_moe_triton``, chosen by the loader when the attention backend is Triton); or, kept in
their GGUF blocks (``quantization=gguf``), by ``moe_quant.QuantExperts``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.moe_arch import MoEArch
from kvpilot.engine.model.moe_experts import select_experts, sorted_moe
from kvpilot.engine.model.moe_quant import QuantExperts
from kvpilot.engine.native.ops import NativeOps

MOE_KERNELS = ("sorted", "triton")


class SharedExpert(nn.Module):
    """Qwen2-MoE's always-on expert: a SwiGLU MLP scaled by ``sigmoid(gate(x))`` per token."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.intermediate = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return torch.sigmoid(self.shared_expert_gate(x)) * self.down_proj(F.silu(gate) * up)


class SparseMoeBlock(nn.Module):
    def __init__(self, hidden: int, moe: MoEArch) -> None:
        super().__init__()
        self.moe = moe
        experts, inter = moe.num_experts, moe.intermediate_size
        self.gate_weight = nn.Parameter(torch.empty(experts, hidden))
        self.w13 = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, inter))
        self.shared_expert = (
            SharedExpert(hidden, moe.shared_expert_intermediate_size)
            if moe.shared_expert_intermediate_size
            else None
        )
        #: how the routed experts run (``MOE_KERNELS``); set by the loader
        self.kernel = "sorted"
        #: fused C kernels for the SiLU-and-multiply of the sorted path (float32 on CPU); None = PyTorch
        self.native: NativeOps | None = None
        #: the routed experts on their GGUF blocks (``keep_quantized_experts``), replacing w13/w2
        self.quant_experts: QuantExperts | None = None

    def keep_quantized_experts(self, experts: QuantExperts) -> None:
        """Serve the routed experts from ``experts`` (``quantization=gguf``): w13/w2 are dropped, and the
        checkpoint's expert tensors are checked present but not read."""
        if (experts.num_experts, experts.inter) != (self.moe.num_experts, self.moe.intermediate_size):
            raise ValueError(f"{experts.num_experts} quantized experts of {experts.inter} for {self.moe}")
        self.quant_experts = experts
        self.w13 = nn.Parameter(torch.empty(0), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = select_experts(F.linear(x, self.gate_weight), self.moe.top_k, self.moe.renormalize)
        if self.quant_experts is not None:
            out = self.quant_experts(x, weights, ids, self.native)
        elif self.kernel == "triton":
            # imported here: TRITON_INTERPRET must be decided before the kernel module loads
            from kvpilot.engine.model.fused_moe_triton import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids)
        else:
            out = sorted_moe(x, self.w13, self.w2, weights, ids, self.native)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out

    def load_hf_weights(self, take: Callable[[str], torch.Tensor], layer_prefix: str) -> None:
        """Copy one layer's router and experts from an HF checkpoint (``take`` marks a name as read):
        Mixtral's ``block_sparse_moe.experts.N.w1/w3/w2`` (gate/up/down) or Qwen's
        ``mlp.experts.N.gate_proj/up_proj/down_proj``, each expert's gate and up fused into ``w13``."""
        if self.moe.naming == "mixtral":
            p, gate, up, down = layer_prefix + "block_sparse_moe.", "w1", "w3", "w2"
        else:
            p, gate, up, down = layer_prefix + "mlp.", "gate_proj", "up_proj", "down_proj"
        _put(self.gate_weight, take(p + "gate.weight"), p + "gate.weight")
        for e in range(self.moe.num_experts):
            q = f"{p}experts.{e}."
            if self.quant_experts is not None:  # held as blocks: present, never read
                for name in (gate, up, down):
                    take(f"{q}{name}.weight")
                continue
            fused = torch.cat([take(f"{q}{gate}.weight"), take(f"{q}{up}.weight")])
            _put(self.w13[e], fused, f"{q}{gate}+{up}.weight")
            _put(self.w2[e], take(f"{q}{down}.weight"), f"{q}{down}.weight")
        if self.shared_expert is not None:
            s = p + "shared_expert."
            fused = torch.cat([take(s + "gate_proj.weight"), take(s + "up_proj.weight")])
            _put_linear(self.shared_expert.gate_up_proj, fused, s + "gate_up_proj.weight")
            _put_linear(self.shared_expert.down_proj, take(s + "down_proj.weight"), s + "down_proj.weight")
            gate_name = p + "shared_expert_gate.weight"
            _put(self.shared_expert.shared_expert_gate.weight, take(gate_name), gate_name)


def _put_linear(layer: nn.Module, value: torch.Tensor, name: str) -> None:
    if isinstance(layer, nn.Linear):  # else a quantized layer already holding the GGUF's blocks
        _put(layer.weight, value, name)


def _put(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(value)


def configure_moe(model: nn.Module, kernel: str, native: NativeOps | None) -> int:
    """Set every MoE block's expert kernel (``MOE_KERNELS``) and native ops; returns how many blocks."""
    if kernel not in MOE_KERNELS:
        raise ValueError(f"unknown MoE kernel {kernel!r}; expected one of {MOE_KERNELS}")
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    for block in blocks:
        block.kernel, block.native = kernel, native
    return len(blocks)
