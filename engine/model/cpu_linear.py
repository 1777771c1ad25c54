"""oneDNN-packed linear layers for CPU inference.

On this project's CPUs (2 cores, AVX2) MKL's sgemm is slow for the short-and-wide products of decoding
(M = batch of 1–64 tokens against 576×3072 weights). oneDNN with the weight pre-packed once into its
blocked layout (what ``torch.compile``'s CPU freezing does) measured 1.5–2x faster per GEMM and 1.4x on a
whole SmolLM2 batch (58 s → 39–43 s for 32 requests). Results differ from MKL only in float summation
order (max |Δ| ~1e-4 on 576-long dot products).

With the native kernels attached (``kvpilot.engine.native``), batches of at most ``NATIVE_MAX_ROWS`` rows
go to its small-M kernel instead, which streams the plain ``[out, in]`` weight faster than oneDNN does
(``bench/native_kernels.py``, 30 SmolLM2 layers: ×1.5 at 1 row, ×1.16 at 8, parity at 24, ×0.95 at 32). That
keeps the plain weight beside the packed one: twice the weight memory of the packed layers.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.native.ops import NativeOps

#: largest row count the native small-M kernel takes (it lost to oneDNN from 32 rows up)
NATIVE_MAX_ROWS = 24


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W packed for oneDNN; ``batch_hint`` tunes the packing (any M works)."""

    def __init__(self, linear: nn.Linear, batch_hint: int, native: NativeOps | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                                      batch_hint))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        usable = native is not None and native.has_fast_linear and self.in_features % 8 == 0
        #: the small-M kernel and the plain weight it reads (None: oneDNN for every batch)
        self.native = native if usable else None
        self.register_buffer("weight", linear.weight.detach() if usable else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def pack_linears(model: nn.Module, batch_hint: int, native: NativeOps | None = None) -> int:
    """Replace every float32 ``nn.Linear`` inside ``model`` by a ``PackedLinear``; returns how many."""
    count = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.float32:
                setattr(module, name, PackedLinear(child, batch_hint, native))
                count += 1
    return count
