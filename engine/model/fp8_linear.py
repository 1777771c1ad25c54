"""fp8 (e4m3) weights: ``Fp8Weight``, quantizing to it, dequantizing it, and ``Fp8Linear``, a W8A16 linear
layer that keeps e4m3 bytes on the device (docs/architecture.md#quantized-weights).

An ``Fp8Weight`` is ``data`` ``[N, K]`` in ``torch.float8_e4m3fn`` and float32 ``scales`` ``[N, G]``: weight
``(n, k)`` is ``data[n, k] * scales[n, k // block_k]``. Every scale layout of the checkpoints kvpilot reads
maps onto it: per-tensor (``G = 1``, the one value on every row), per-channel (``G = 1``) and block-wise
``[bn, bk]`` (``block_k = bk``, each row carrying its block row's scales). Keeping a row's scales with the
row lets fused projections (q/k/v, gate/up) concatenate parts with different scales even where a part's row
count is no multiple of ``bn``; it costs ``4 G`` bytes a row (3% of the e4m3 bytes at ``bk = 128``).

``Fp8Linear`` runs the Triton W8A16 GEMM on the e4m3 bytes (``fp8_triton``) with ``linear_backend='triton'``
(the default on CUDA): each weight is read as one byte and decoded in registers. Otherwise it dequantizes its
weight into the activation dtype on every call and runs ``F.linear`` (memory still holds e4m3, half of bf16,
but every call writes and reads a dequantized copy). Activations stay in their dtype (W8A16): a checkpoint's
static ``input_scale`` is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
#: largest finite e4m3 value (448)
FP8_MAX = torch.finfo(FP8_DTYPE).max


@dataclass
class Fp8Weight:
    """A ``[out_features, in_features]`` weight as e4m3 ``data`` times ``scales`` (module docstring)."""

    data: torch.Tensor
    scales: torch.Tensor
    #: inputs sharing one scale along a row (``in_features`` for per-tensor and per-channel scales)
    block_k: int

    def __post_init__(self) -> None:
        n, k = self.data.shape
        groups = -(-k // self.block_k)
        if self.data.dtype != FP8_DTYPE or tuple(self.scales.shape) != (n, groups):
            raise ValueError(
                f"an fp8 weight needs float8_e4m3fn data and [rows, {groups}] scales, got {self.data.dtype} "
                f"data and scales of shape {tuple(self.scales.shape)}"
            )

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]

    def to(self, device: torch.device) -> Fp8Weight:
        return Fp8Weight(self.data.to(device), self.scales.to(device), self.block_k)


def expand_scales(
    scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int] | None, name: str
) -> tuple[torch.Tensor, int]:
    """A checkpoint's scale tensor for a ``[rows, cols]`` weight as ``(scales [rows, G], block_k)``: one
    element is per-tensor, ``[rows]`` or ``[rows, 1]`` per-channel, ``[ceil(rows/bn), ceil(cols/bk)]``
    block-wise for ``block = (bn, bk)``; ``ValueError`` naming ``name`` for any other shape."""
    scale = scale.float()
    if scale.numel() == 1:
        return scale.reshape(1, 1).expand(rows, 1).contiguous(), cols
    if tuple(scale.shape) in ((rows,), (rows, 1)):
        return scale.reshape(rows, 1).contiguous(), cols
    if block is not None:
        bn, bk = block
        if tuple(scale.shape) == (-(-rows // bn), -(-cols // bk)):
            return scale.repeat_interleave(bn, dim=0)[:rows].contiguous(), bk
    expected = (
        "[1], [rows] or [rows, 1]"
        if block is None
        else f"those or [ceil(rows/{block[0]}), ceil(cols/{block[1]})]"
    )
    raise ValueError(
        f"{name} has shape {tuple(scale.shape)} for a [{rows}, {cols}] weight; expected {expected}"
    )


def dequantize_fp8(weight: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weight in ``dtype``: each e4m3 value times its scale in float32, rounded once to ``dtype``."""
    n, k = weight.data.shape
    w = weight.data.to(torch.float32)
    if weight.scales.shape[1] == 1:
        w = w * weight.scales
    elif k % weight.block_k == 0:
        w = (w.view(n, -1, weight.block_k) * weight.scales[..., None]).view(n, k)
    else:
        w = w * weight.scales.repeat_interleave(weight.block_k, dim=1)[:, :k]
    return w.to(dtype)


def quantize_fp8(weight: torch.Tensor) -> Fp8Weight:
    """Per-output-row e4m3 of a float ``[out, in]`` weight (vLLM's online fp8 is per-tensor; a scale per row
    loses less): ``scale = max |w_row| / 448`` (an all-zero row gets scale 1), ``q = w / scale`` rounded to
    the nearest e4m3."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1, keepdim=True) / FP8_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    data = (w / scales).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(data.contiguous(), scales.contiguous(), w.shape[1])


def concat_fp8_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """One weight whose rows are ``parts``' rows in order (a fused q/k/v or gate/up projection)."""
    first = parts[0]
    for part in parts[1:]:
        if part.block_k != first.block_k or part.in_features != first.in_features:
            raise ValueError(
                f"cannot fuse fp8 rows of {part.in_features} inputs in scale blocks of {part.block_k} with "
                f"rows of {first.in_features} inputs in blocks of {first.block_k}"
            )
    if len(parts) == 1:
        return first
    return Fp8Weight(torch.cat([p.data for p in parts]), torch.cat([p.scales for p in parts]), first.block_k)


#: K inputs per step of the W8A8 Triton GEMM (``fp8_triton.BLOCK_K``): each step takes one weight scale
W8A8_K_STEP = 64


def w8a8_supported(block_k: int, in_features: int) -> bool:
    """Whether the W8A8 GEMM can scale each K step by one weight group: one group per row, or groups of
    whole steps."""
    return block_k > 0 and (block_k >= in_features or block_k % W8A8_K_STEP == 0)


class Fp8Linear(nn.Module):
    """``y = x Wᵀ + b`` on an e4m3 ``W`` (buffers ``qweight`` and ``scales``); ``bias`` in ``dtype`` (loaded
    later from the checkpoint) when ``has_bias``; ``triton``: the Triton W8A16 GEMM computes it."""

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: Fp8Weight, has_bias: bool, dtype: torch.dtype, triton: bool = False) -> None:
        super().__init__()
        self.triton = triton
        #: W8A8 (``activation_quantization='fp8'``): the Triton GEMM rounds x to e4m3 per row too
        self.fp8_activations = False
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.block_k = weight.block_k
        self.register_buffer("qweight", weight.data)
        self.register_buffer("scales", weight.scales)
        bias = torch.zeros(self.out_features, dtype=dtype, device=weight.data.device) if has_bias else None
        self.register_buffer("bias", bias)

    @property
    def weight_fp8(self) -> Fp8Weight:
        return Fp8Weight(self.qweight, self.scales, self.block_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.triton:
            return F.linear(x, dequantize_fp8(self.weight_fp8, x.dtype), self.bias)
        # imported at the first call: Triton reads TRITON_INTERPRET when the kernel module loads
        from kvpilot.engine.model.fp8_triton import fp8_linear, fp8_w8a8_linear

        flat = x.reshape(-1, self.in_features).contiguous()
        gemm = fp8_w8a8_linear if self.fp8_activations else fp8_linear
        y = gemm(flat, self.qweight, self.scales, self.block_k, self.bias)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        kernel = ("triton-w8a8" if self.fp8_activations else "triton") if self.triton else "dequantize"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block_k={self.block_k}, "
            f"kernel={kernel}"
        )
