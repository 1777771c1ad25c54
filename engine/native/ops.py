"""Tensor-level wrappers of the C kernels (their PyTorch references: ``reference.py``).

``NativeOps`` validates what the kernels assume (float32, CPU, unit stride inside a row, the shapes
that belong together) and raises ``ValueError`` otherwise, so a caller never hands C a layout it would
misread. Rows may have any stride: q/k/v are column slices of the fused qkv projection.
``load_native_ops(cache_dir)`` compiles/loads the library (``build.py``); callers decide what to do when
it raises ``NativeBuildError`` (the engine falls back to PyTorch ops for ``native_cpu_ops="auto"``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from pathlib import Path

import torch

from kvpilot.engine.kv.kv_quant import KVQuant
from kvpilot.engine.model.rope import rotary_width
from kvpilot.engine.native.build import load_library
from kvpilot.engine.native.decode_step_ops import DecodeStepKernels
from kvpilot.engine.native.kv_args import kv_cache_args
from kvpilot.engine.native.paged_attention_ops import PagedAttentionKernels
from kvpilot.engine.native.quant_ops import QuantKernels
from kvpilot.engine.native.sampling_ops import SamplingKernels
from kvpilot.engine.native.tensor_checks import check_contiguous, row_stride
from kvpilot.engine.native.vnni_ops import VnniKernels

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_T = ctypes.c_int
_SIGNATURES = {
    "kvp_add_rms_norm": (_P, _I, _P, _I, _P, _P, _I, _I, _F, _T),
    "kvp_rope_inplace": (_P, _I, _I, _I, _I, _I, _P, _P, _P, _T),
    "kvp_write_kv": (_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _T, _P, _P, _F, _F, _T),
    "kvp_silu_mul": (_P, _P, _I, _I, _T),
    "kvp_gelu_tanh_mul": (_P, _P, _I, _I, _T),
    "kvp_linear": (_P, _I, _P, _P, _P, _I, _I, _I, _T),
}
#: output columns per panel of ``linear``'s packed weight layout (small_gemm.c's PANEL)
LINEAR_PANEL = 16


class NativeOps:
    """The loaded kernels. Every method works in place or on an ``out`` it allocates, as documented."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        lib.kvp_has_avx2.restype = ctypes.c_int
        #: whether ``linear`` has its vector kernel (else a scalar loop: callers should keep their GEMM)
        self.has_fast_linear = bool(lib.kvp_has_avx2())
        #: paged decode and prefill attention over the KV cache (``paged_attention_ops``)
        self.attention = PagedAttentionKernels(lib, threads=self._threads, has_avx2=self.has_fast_linear)
        #: the quantized-weight GEMM (``quant_ops``)
        self.quant = QuantKernels(lib)
        #: the int8-activation GEMM on repacked weights (``vnni_ops``; ``available`` False without AVX2)
        self.vnni = VnniKernels(lib)
        #: the sampler's temperature, truncation and draw for sampled rows (``sampling_ops``)
        self.sampling = SamplingKernels(lib)
        #: a decode step's layers in one call (``decode_step_ops``, used by ``model.native_decode``)
        self.decode_step = DecodeStepKernels(lib)

    @staticmethod
    def _threads() -> int:
        return torch.get_num_threads()

    def add_rms_norm(
        self, residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """``residual += delta`` (in place, when given), then RMSNorm of ``residual`` into a new tensor."""
        tokens, hidden = residual.shape
        rs = row_stride(residual, "residual")
        ds = 0 if delta is None else row_stride(delta, "delta", hidden)
        if delta is not None and delta.shape[0] != tokens:
            raise ValueError(f"delta has {delta.shape[0]} rows, residual {tokens}")
        check_contiguous(weight, "weight", torch.float32)
        out = torch.empty(tokens, hidden)
        self._lib.kvp_add_rms_norm(
            residual.data_ptr(),
            rs,
            None if delta is None else delta.data_ptr(),
            ds,
            weight.data_ptr(),
            out.data_ptr(),
            tokens,
            hidden,
            eps,
            self._threads(),
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
        """Rotate the first ``num_heads`` heads of every row of ``x`` in place (rotate-half RoPE) over their
        first ``cos.shape[1]`` dims (all ``head_dim`` of them, or fewer: partial rotary)."""
        xs = row_stride(x, "x")
        rotary = rotary_width(x, num_heads, head_dim, cos)
        check_contiguous(positions, "positions", torch.int64)
        for table, name in ((cos, "cos"), (sin, "sin")):
            check_contiguous(table, name, torch.float32)
            if table.dim() != 2 or table.shape[1] != rotary:
                raise ValueError(f"{name} table must be [max_position, {rotary}], got {tuple(table.shape)}")
        if positions.numel() != x.shape[0]:
            raise ValueError(f"{positions.numel()} positions for {x.shape[0]} rows")
        if positions.numel() and not 0 <= int(positions.min()) <= int(positions.max()) < cos.shape[0]:
            raise ValueError(f"positions must lie in [0, {cos.shape[0]})")
        self._lib.kvp_rope_inplace(
            x.data_ptr(),
            xs,
            x.shape[0],
            num_heads,
            rotary,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            self._threads(),
        )

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slots: torch.Tensor,
        quant: KVQuant | None = None,
    ) -> None:
        """Scatter ``key``/``value`` ``[T, Hkv * D]`` rows into HND caches at ``slots`` (< 0: skip), as
        ``quant``'s codes (and int8's row scales) when given."""
        num_blocks, kv_heads, block_size, head_dim = key_cache.shape
        ks, vs = row_stride(key, "key", kv_heads * head_dim), row_stride(value, "value", kv_heads * head_dim)
        kv = kv_cache_args(key_cache, value_cache, quant)
        check_contiguous(slots, "slots", torch.int64)
        if (
            value_cache.shape != key_cache.shape
            or slots.numel() != key.shape[0]
            or value.shape[0] != key.shape[0]
        ):
            raise ValueError("key/value rows, slots and the two caches' shapes must agree")
        if slots.numel() and int(slots.max()) >= num_blocks * block_size:
            raise ValueError(
                f"slot {int(slots.max())} is outside the cache ({num_blocks * block_size} slots)"
            )
        self._lib.kvp_write_kv(
            key.data_ptr(),
            ks,
            value.data_ptr(),
            vs,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            slots.data_ptr(),
            key.shape[0],
            kv_heads,
            head_dim,
            block_size,
            *kv,
            self._threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for the fused ``[T, 2I]`` projection (gate first), as a new ``[T, I]``."""
        return self._gated(self._lib.kvp_silu_mul, gate_up)

    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``gelu(gate, approximate="tanh") * up`` (GeGLU), laid out as ``silu_mul``'s."""
        return self._gated(self._lib.kvp_gelu_tanh_mul, gate_up)

    def _gated(self, kernel: Callable[..., None], gate_up: torch.Tensor) -> torch.Tensor:
        check_contiguous(gate_up, "gate_up", torch.float32)
        if gate_up.dim() != 2 or gate_up.shape[1] % 2:
            raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
        tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, inter)
        kernel(gate_up.data_ptr(), out.data_ptr(), tokens, inter, self._threads())
        return out

    @staticmethod
    def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[N, K]`` (nn.Linear's layout) as the ``[ceil(N / 16), K, 16]`` column panels
        ``linear`` reads: ``packed[p, k, j] = weight[16 p + j, k]``, zero past ``N``."""
        check_contiguous(weight, "weight", torch.float32)
        if weight.dim() != 2:
            raise ValueError(f"weight must be 2-D [out, in], got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        panels = -(-out_features // LINEAR_PANEL)
        padded = torch.zeros(panels * LINEAR_PANEL, in_features)
        padded[:out_features] = weight
        return padded.view(panels, LINEAR_PANEL, in_features).transpose(1, 2).contiguous()

    def linear(
        self, x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int
    ) -> torch.Tensor:
        """``x @ weight.T + bias`` with the weight as ``pack_linear_weight`` made it, for decode-sized
        batches (callers pick it by row count, ``cpu_linear.NATIVE_MAX_ROWS``, and keep oneDNN for
        prefill)."""
        rows = x.shape[0]
        xs = row_stride(x, "x")
        check_contiguous(packed_weight, "packed_weight", torch.float32)
        panels = -(-out_features // LINEAR_PANEL)
        if packed_weight.shape != (panels, x.shape[1], LINEAR_PANEL):
            raise ValueError(
                f"packed_weight must be [{panels}, {x.shape[1]}, {LINEAR_PANEL}] for {out_features} "
                f"outputs of {x.shape[1]} inputs, got {tuple(packed_weight.shape)}"
            )
        if bias is not None:
            check_contiguous(bias, "bias", torch.float32)
            if bias.shape != (out_features,):
                raise ValueError(f"bias must be [{out_features}], got {tuple(bias.shape)}")
        out = torch.empty(rows, out_features)
        self._lib.kvp_linear(
            x.data_ptr(),
            xs,
            packed_weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            x.shape[1],
            self._threads(),
        )
        return out


def load_native_ops(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> NativeOps:
    return NativeOps(load_library(cache_dir, extra_flags))
