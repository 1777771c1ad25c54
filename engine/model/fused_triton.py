"""The decoder layer's element-wise work as Triton kernels, for the fused layer path on CUDA
(``DecoderLayer.forward_native`` with ``TritonFusedOps`` in place of the C kernels).

The plain PyTorch layer launches several kernels for each of these steps: a residual add and RMSNorm
are about six (add, cast, square, mean, rsqrt, two multiplies), rotate-half RoPE about ten for q and k
(two ``cat``s, negations, four multiplies, two adds, slicing copies), the gated activation three. Here
each is one launch per step and layer, reading and writing every element once:

- ``add_rms_norm``: ``residual += delta`` in place (rounded to the activation dtype, as the separate add
  is), then RMSNorm of the sum in float32; the weight multiplies in its own dtype, as HF's layers do
  (Llama: ``weight * x.to(dtype)``; Gemma's float32 ``1 + w``: before the cast);
- ``rope_``: rotate-half RoPE in place over each head's first ``rotary`` dims, q and k heads in one pass
  (they lead the fused qkv projection's rows), the tables read at the tokens' positions. The engine's
  Triton attention backend applies the same rotation inside its K/V write instead (one launch for both,
  ``attention/kernels/kv_write.py``); this one serves a layer whose backend does not;
- ``silu_mul`` / ``gelu_tanh_mul``: the gated MLP's activation of ``[gate | up]`` rows, the activation
  rounded to the activation dtype before the multiply (as ``F.silu(gate) * up``).

Every value is computed in float32 and rounded once where the PyTorch layer rounds, so float32 results
agree with it to rounding and half-precision ones within one unit in the last place. The references are
the PyTorch layer itself (``layers.RMSNorm``, ``rope.RotaryEmbedding.rotate``, ``F.silu``); the tests
hold each kernel to them in the Triton interpreter (float32, float16) and, on a GPU, compiled.
Import this module only after ``TRITON_INTERPRET`` is decided, as for the attention kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvpilot.engine.attention.kernels.launch_math import cdiv, next_power_of_2
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.model.rope import rotary_width

#: widest row one program normalises in registers (hidden sizes of current models are <= 16384)
MAX_HIDDEN = 32768


@triton.jit
def _add_rms_norm_kernel(
    residual_ptr,
    delta_ptr,
    weight_ptr,
    out_ptr,
    stride_r,
    stride_d,
    stride_o,
    hidden,
    eps,
    HAS_DELTA: tl.constexpr,
    SCALE_IN_FP32: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    valid = cols < hidden
    x = tl.load(residual_ptr + row * stride_r + cols, mask=valid, other=0.0)
    if HAS_DELTA:
        d = tl.load(delta_ptr + row * stride_d + cols, mask=valid, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + cols, x, mask=valid)
    x32 = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    if SCALE_IN_FP32:
        y = x32 * inv * w
    else:  # the normalised row rounds to the activation dtype first, then the weight multiplies
        y = (x32 * inv).to(out_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _rope_kernel(
    x_ptr,
    positions_ptr,
    cos_ptr,
    sin_ptr,
    stride_x,
    stride_table,
    head_dim,
    half,
    HALF_PADDED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    dims = tl.arange(0, HALF_PADDED)
    valid = dims < half
    pos = tl.load(positions_ptr + token).to(tl.int64)
    base = x_ptr + token * stride_x + head * head_dim
    x1 = tl.load(base + dims, mask=valid, other=0.0).to(tl.float32)
    x2 = tl.load(base + half + dims, mask=valid, other=0.0).to(tl.float32)
    table = pos * stride_table
    cos1 = tl.load(cos_ptr + table + dims, mask=valid, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + half + dims, mask=valid, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table + dims, mask=valid, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + half + dims, mask=valid, other=0.0).to(tl.float32)
    out_dtype = x_ptr.dtype.element_ty
    tl.store(base + dims, (x1 * cos1 - x2 * sin1).to(out_dtype), mask=valid)
    tl.store(base + half + dims, (x2 * cos2 + x1 * sin2).to(out_dtype), mask=valid)


@triton.jit
def _gated_kernel(
    gate_up_ptr,
    out_ptr,
    stride_in,
    stride_out,
    inter,
    GELU: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < inter
    gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=valid, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_in + inter + cols, mask=valid, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1) saturates without overflow
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(tl.minimum(2.0 * z, 80.0)) + 1.0))
    else:  # exp(80) is finite in float32 and already makes the quotient 0 (or 1) to every precision
        act = gate / (1.0 + tl.exp(tl.minimum(-gate, 80.0)))
    out_dtype = out_ptr.dtype.element_ty
    tl.store(
        out_ptr + row * stride_out + cols, (act.to(out_dtype).to(tl.float32) * up).to(out_dtype), mask=valid
    )


def _check_rows(x: torch.Tensor, name: str) -> None:
    if x.dim() != 2 or (x.shape[1] > 1 and x.stride(1) != 1):
        raise ValueError(
            f"{name} must be 2-D with contiguous rows, got {tuple(x.shape)} strides {x.stride()}"
        )


class TritonFusedOps:
    """The fused layer path's element-wise operations (the interface ``native.ops.NativeOps`` offers on
    the CPU) as Triton kernels, for any floating dtype on the tensors' device."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` (in place, when given), then RMSNorm of ``residual`` times ``weight``
        into a new tensor."""
        _check_rows(residual, "residual")
        tokens, hidden = residual.shape
        if delta is not None:
            _check_rows(delta, "delta")
            if delta.shape != residual.shape:
                raise ValueError(f"delta {tuple(delta.shape)} must match residual {tuple(residual.shape)}")
        if weight.shape != (hidden,) or not weight.is_contiguous():
            raise ValueError(f"weight must be a contiguous [{hidden}], got {tuple(weight.shape)}")
        if hidden > MAX_HIDDEN:
            raise ValueError(f"hidden size {hidden} exceeds {MAX_HIDDEN}")
        out = torch.empty(tokens, hidden, dtype=residual.dtype, device=residual.device)
        if tokens:
            _add_rms_norm_kernel[(tokens,)](
                residual,
                residual if delta is None else delta,
                weight,
                out,
                residual.stride(0),
                0 if delta is None else delta.stride(0),
                out.stride(0),
                hidden,
                eps,
                HAS_DELTA=delta is not None,
                SCALE_IN_FP32=weight.dtype == torch.float32 and residual.dtype != torch.float32,
                BLOCK=next_power_of_2(hidden),
                num_warps=4 if hidden <= 4096 else 8,
            )
        return out

    def rope_(
        self,
        x: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None:
        """Rotate the first ``num_heads`` heads of every row of ``x`` in place (rotate-half RoPE) over
        their first ``cos.shape[1]`` dims, with the tables' rows at ``positions``."""
        _check_rows(x, "x")
        rotary = rotary_width(x, num_heads, head_dim, cos)
        QKRotation(positions, cos, sin).rotary_dim(head_dim, x.shape[0])  # the tables and positions
        if x.shape[0] and num_heads:
            half = rotary // 2
            _rope_kernel[(x.shape[0], num_heads)](
                x,
                positions,
                cos,
                sin,
                x.stride(0),
                cos.stride(0),
                head_dim,
                half,
                HALF_PADDED=next_power_of_2(half),
                num_warps=1,
            )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for the fused ``[T, 2I]`` projection (gate first), as a new ``[T, I]``."""
        return self._gated(gate_up, gelu=False)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU), laid out as ``silu_mul``'s."""
        return self._gated(gate_up, gelu=True)

    @staticmethod
    def _gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
        _check_rows(gate_up, "gate_up")
        if gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, next_power_of_2(inter))
        if tokens and inter:
            _gated_kernel[(tokens, cdiv(inter, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), inter, GELU=gelu, BLOCK=block, num_warps=4
            )
        return out
