"""oneDNN-packed linear layers for CPU inference.

On this project's CPUs (2 cores, AVX2) MKL's sgemm is slow for the short-and-wide products of decoding
(M = batch of 1–64 tokens against 576×3072 weights). oneDNN with the weight pre-packed once into its
blocked layout (what ``torch.compile``'s CPU freezing does) measured 1.5–2x faster per GEMM and 1.4x on a
whole SmolLM2 batch (58 s → 39–43 s for 32 requests). Results differ from MKL only in float summation
order (max |Δ| ~1e-4 on 576-long dot products).

With the native kernels attached (``kvpilot.engine.native``), batches of at most ``NATIVE_MAX_ROWS`` rows
(every decode step of a default engine) go to its GEMM instead, on a second copy of the weight packed in
16-column panels: ``bench/native_kernels.py`` (30 SmolLM2 layers streamed from memory) measured it ×1.4–1.6
faster than oneDNN at 1–16 rows, ×1.2–1.35 at 24–64; alternating runs on 8 layers read ×1.08 at 128 rows,
×1.02 at 256, ×1.12 at 512, ×0.96 at 1024 and ×0.95 at 2048. The cost is twice the weight memory of the
packed layers (the oneDNN copy serves prefill).
"""

from __future__ import annotations

import torch
from torch import nn

from kvpilot.engine.native.ops import NativeOps

#: largest row count the native GEMM takes (at parity with oneDNN from ~256 rows, behind from ~1024)
NATIVE_MAX_ROWS = 256


def onednn_available() -> bool:
    return bool(torch.backends.mkldnn.is_available()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    """``y = x Wᵀ + b`` with W packed for oneDNN; ``batch_hint`` tunes the packing (any M works)."""

    packed_weight: torch.Tensor
    bias: torch.Tensor | None
    panel_weight: torch.Tensor | None

    def __init__(self, linear: nn.Linear, batch_hint: int, native: NativeOps | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        )
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        fast = native if native is not None and native.has_fast_linear else None
        #: the native GEMM and the panel-packed weight it reads (None: oneDNN for every batch)
        self.native = fast
        self.register_buffer(
            "panel_weight",
            None if fast is None else fast.pack_linear_weight(linear.weight.detach().contiguous()),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the panels are packed with ``native`` set: both are set or neither
        if self.native is not None and self.panel_weight is not None and x.shape[0] <= NATIVE_MAX_ROWS:
            return self.native.linear(x, self.panel_weight, self.bias, self.out_features)
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
