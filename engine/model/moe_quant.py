"""Routed experts kept in their GGUF blocks (``quantization=gguf``; docs/models.md#gguf).

``QuantExperts`` holds each expert's two projections as ``QuantLinear`` layers on the file's own bytes:
``gate_up[e]`` (the expert's ``ffn_gate_exps`` rows, then its ``ffn_up_exps`` rows: ``w13``'s layout) and
``down[e]`` (``ffn_down_exps``), in a format the kernels run (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K). A Q4_0 expert of
Mixtral-8x7B is ~4.5 bits a weight where float32 is 32.

Its forward is ``moe_experts.sorted_moe``'s path with each GEMM on the blocks: the ``T * k`` (token,
expert) assignments sorted by expert, so each expert some token chose runs its two ``QuantLinear``
products once over its contiguous rows (the Triton GEMM with ``triton``; else the native quantized GEMM up
to ``QUANT_NATIVE_MAX_ROWS`` rows, beyond per slice dequantized and torch's GEMM; PyTorch dequantization
without the native kernels), and
experts no token chose are never read. The result equals ``moe_experts.reference_moe`` on the dequantized
weights up to float32 summation order (``tests/engine/test_moe_quant.py``).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.model.quant_formats import QuantWeight, dequantize
from kvpilot.engine.model.quant_linear import QuantLinear
from kvpilot.engine.native.ops import NativeOps


class QuantExperts(nn.Module):
    """The routed experts of one sparse layer on quantized weights: ``gate_up[e]`` ``[2I, H]`` and
    ``down[e]`` ``[H, I]`` per expert."""

    def __init__(
        self,
        gate_up: list[QuantWeight],
        down: list[QuantWeight],
        native: NativeOps | None,
        triton: bool = False,
    ) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError(f"{len(gate_up)} gate/up and {len(down)} down expert weights")
        hidden, inter = gate_up[0].in_features, down[0].in_features
        for up, dn in zip(gate_up, down, strict=True):
            if (up.in_features, up.out_features, dn.in_features, dn.out_features) != (
                hidden,
                2 * inter,
                inter,
                hidden,
            ):
                raise ValueError(
                    f"expert weights [{up.out_features}, {up.in_features}] / [{dn.out_features}, "
                    f"{dn.in_features}] do not fit hidden {hidden} and expert size {inter}"
                )
        self.hidden, self.inter = hidden, inter
        self.gate_up = nn.ModuleList(QuantLinear(w, False, native, triton) for w in gate_up)
        self.down = nn.ModuleList(QuantLinear(w, False, native, triton) for w in down)

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]``) in float32: the reference's weights."""
        # an nn.ModuleList types its items as Module: these are the QuantLinear layers built above
        gate_up = cast("list[QuantLinear]", list(self.gate_up))
        down = cast("list[QuantLinear]", list(self.down))
        w13 = torch.stack([dequantize(layer.weight_q) for layer in gate_up])
        return w13, torch.stack([dequantize(layer.weight_q) for layer in down])

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, native: NativeOps | None = None
    ) -> torch.Tensor:
        """The routed experts' output ``[T, H]`` for the routing (``weights``, ``ids``) ``[T, k]``."""
        tokens, top_k = ids.shape
        if x.shape != (tokens, self.hidden):
            raise ValueError(f"x {tuple(x.shape)} for {tokens} routed tokens of hidden size {self.hidden}")
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        if len(counts) > self.num_experts:
            raise ValueError(f"routing names expert {len(counts) - 1} of {self.num_experts}")
        gathered = x.index_select(0, order // top_k)  # [T*k, H], expert by expert
        out = torch.empty(tokens * top_k, self.hidden, dtype=x.dtype, device=x.device)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            end = start + count
            gate_up = self.gate_up[expert](gathered[start:end])
            if native is not None and gate_up.dtype == torch.float32:
                act = native.silu_mul(gate_up)
            else:
                act = F.silu(gate_up[:, : self.inter]) * gate_up[:, self.inter :]
            out[start:end] = self.down[expert](act)
            start = end
        out.mul_(weights.reshape(-1)[order, None].to(out.dtype))
        # back to (token, slot) order, then each token's k outputs summed
        unsorted = torch.empty_like(out).index_copy_(0, order, out)
        return unsorted.view(tokens, top_k, self.hidden).sum(1)
