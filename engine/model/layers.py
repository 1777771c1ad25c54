"""The decoder layer every family shares: RMSNorm, attention through the attention backend, a gated MLP.

Numerics follow HF transformers (RMSNorm in float32, rotate-half RoPE, SwiGLU/GeGLU), so greedy outputs
match the HF class of each family with the same weights. The family switches are ``ModelArchConfig``
fields (docs/models.md): q/k norm (Qwen3, Gemma 3), Gemma's ``(1 + w)`` norms after each sublayer too, a
per-layer window, scale and soft-cap (``LayerAttention``), the MLP's activation.

A layer's ``mlp`` is any module mapping ``[T, H]`` to ``[T, H]``: the dense ``MLP`` here or the
Mixture-of-Experts block of ``moe`` (chosen per layer from ``arch.moe``). ``forward_native``, when the
module has one, is what the fused path calls instead of ``forward``.

``DecoderLayer.forward_native`` is the fused path, on ``FusedOps``: the C kernels (float32 on CPU,
``kvpilot.engine.native``) or the Triton kernels (CUDA, ``fused_triton``). The residual stream is kept
apart and each RMSNorm also adds the sublayer output into it (one pass instead of ~8 small ops), RoPE
rotates q and k in place inside the fused qkv rows (inside the K/V write's launch where the attention
backend ``rotates_in_kv_write``: Triton), and the MLP's activation is one kernel. Only the
float summation order (and, in half precision, RoPE's single rounding) differs from the PyTorch path.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kvpilot.engine.attention.backend import AttentionBackend, LayerAttention
from kvpilot.engine.attention.metadata import AttentionMetadata
from kvpilot.engine.attention.rotation import QKRotation
from kvpilot.engine.kv.kv_quant import LayerKV
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.moe import SparseMoeBlock
from kvpilot.engine.model.rope import RotaryEmbedding

RopeTables = tuple[torch.Tensor, torch.Tensor]


class FusedOps(Protocol):
    """What the fused layer path (``forward_native``) calls: the C kernels on the CPU
    (``native.ops.NativeOps``, float32) or the Triton kernels on CUDA (``fused_triton.TritonFusedOps``)."""

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor: ...

    def rope_(
        self,
        x: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> None: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """HF's RMSNorm; ``unit_offset`` is Gemma's, which scales by ``1 + w`` in float32 before casting back."""

    def __init__(self, size: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.unit_offset:
            return (x32 * (1.0 + self.weight.float())).to(dtype)
        return self.weight * x32.to(dtype)

    def scale(self) -> torch.Tensor:
        """The multiplier the fused kernels apply (``add_rms_norm``): the weight, or Gemma's ``1 + w`` in
        float32 (as ``forward`` computes it)."""
        return 1.0 + self.weight.float() if self.unit_offset else self.weight


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig, index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads,
            arch.num_key_value_heads,
            arch.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        # q, k and v in one GEMM: one weight read per step instead of three. The projections are built as
        # nn.Linear; loading may replace them (quantized, fp8, oneDNN-packed, row-parallel layers)
        self.qkv_proj: nn.Module = nn.Linear(
            arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.qkv_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, arch.hidden_size, bias=arch.o_bias)
        norm = arch.qk_norm
        self.q_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.gemma_norms) if norm else None
        self.k_norm = RMSNorm(self.head_dim, arch.rms_norm_eps, arch.gemma_norms) if norm else None
        #: how this layer attends (its window, scale, soft-cap)
        self.params = LayerAttention(arch.attention_scale, arch.layer_windows[index], arch.attn_logit_softcap)
        #: which of the model's rotary tables this layer rotates with
        self.rope_spec = arch.layer_rope(index)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeTables,
        backend: AttentionBackend,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v = self._heads(self.qkv_proj(hidden))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.rotate(q, k, *rope)
        return self._attend(q, k, v, backend, kv_cache, meta)

    def forward_native(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
        native: FusedOps,
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = self._heads(qkv)  # views into qkv: normalised in place, rotated next
            q.copy_(self.q_norm(q))
            k.copy_(self.k_norm(k))
        if backend.rotates_in_kv_write:  # RoPE inside the K/V write: one launch for both
            rotation = QKRotation(positions, rotary.cos, rotary.sin)
            return self._attend(*self._heads(qkv), backend, kv_cache, meta, rotation)
        # q heads then k heads lead each row: one in-place pass rotates both
        native.rope_(
            qkv, self.num_heads + self.num_kv_heads, self.head_dim, positions, rotary.cos, rotary.sin
        )
        return self._attend(*self._heads(qkv), backend, kv_cache, meta)

    def _heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``[T, Hq, D]``, ``[T, Hkv, D]``, ``[T, Hkv, D]`` views of the fused projection's columns."""
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = qkv.shape[0]
        return (
            q.view(tokens, self.num_heads, self.head_dim),
            k.view(tokens, self.num_kv_heads, self.head_dim),
            v.view(tokens, self.num_kv_heads, self.head_dim),
        )

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        backend: AttentionBackend,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
        rotation: QKRotation | None = None,
    ) -> torch.Tensor:
        out = backend.forward(
            q, k, v, kv_cache.key, kv_cache.value, meta, self.params, kv_cache.quant, rotation
        )
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class MLP(nn.Module):
    """The gated MLP: ``down(act(gate(x)) * up(x))``, SiLU (SwiGLU) or tanh-approximated GELU (GeGLU)."""

    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.intermediate = arch.intermediate_size
        self.gelu = arch.hidden_act == "gelu_pytorch_tanh"
        # nn.Linear as built; loading may replace them (quantized, fp8, oneDNN-packed, row-parallel layers)
        self.gate_up_proj: nn.Module = nn.Linear(
            arch.hidden_size, 2 * arch.intermediate_size, bias=arch.mlp_bias
        )
        self.down_proj: nn.Module = nn.Linear(arch.intermediate_size, arch.hidden_size, bias=arch.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)

    def forward_native(self, x: torch.Tensor, native: FusedOps) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        return self.down_proj(native.gelu_tanh_mul(gate_up) if self.gelu else native.silu_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, index: int) -> None:
        super().__init__()
        eps, gemma = arch.rms_norm_eps, arch.gemma_norms
        self.input_layernorm = RMSNorm(arch.hidden_size, eps, gemma)
        self.self_attn = Attention(arch, index)
        # Llama: the norm before the MLP; Gemma: the norm of the attention output (its pre-MLP norm follows)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps, gemma)
        self.pre_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, gemma) if gemma else None
        self.post_feedforward_layernorm = RMSNorm(arch.hidden_size, eps, gemma) if gemma else None
        moe = arch.moe  # a sparse layer's MLP is its experts (docs/architecture.md#mixture-of-experts)
        sparse = moe is not None and moe.sparse_layers[index]
        self.mlp: nn.Module = SparseMoeBlock(arch.hidden_size, moe) if moe and sparse else MLP(arch)

    def forward(
        self,
        hidden: torch.Tensor,
        rope: RopeTables,
        backend: AttentionBackend,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(hidden), rope, backend, kv_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            hidden = hidden + attn
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))

    def forward_native(
        self,
        residual: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        backend: AttentionBackend,
        kv_cache: LayerKV,
        meta: AttentionMetadata,
        native: FusedOps,
        next_norm: RMSNorm,
    ) -> torch.Tensor:
        """``hidden`` is this layer's input norm of ``residual``; the sublayer outputs are added into
        ``residual`` in place, and ``next_norm`` of it (the next layer's input norm, or the final norm)
        is returned."""
        attn = self.self_attn.forward_native(hidden, positions, rotary, backend, kv_cache, meta, native)
        pre, post = self.pre_feedforward_layernorm, self.post_feedforward_layernorm
        if pre is None or post is None:
            hidden = _add_norm(native, residual, attn, self.post_attention_layernorm)
        else:
            hidden = _add_norm(
                native, residual, _add_norm(native, attn, None, self.post_attention_layernorm), pre
            )
        forward_native = getattr(self.mlp, "forward_native", None)
        mlp = forward_native(hidden, native) if forward_native is not None else self.mlp(hidden)
        if post is not None:
            mlp = _add_norm(native, mlp, None, post)
        return _add_norm(native, residual, mlp, next_norm)


def _add_norm(
    native: FusedOps, residual: torch.Tensor, delta: torch.Tensor | None, norm: RMSNorm
) -> torch.Tensor:
    """``residual += delta`` (when given), then ``norm(residual)``, in one kernel pass."""
    return native.add_rms_norm(residual, delta, norm.scale(), norm.eps)
