"""Tensor-level wrappers of the C kernels (their PyTorch references: ``reference.py``).

``NativeOps`` validates what the kernels assume (float32, CPU, unit stride inside a row, the shapes
that belong together) and raises ``ValueError`` otherwise, so a caller never hands C a layout it would
misread. Rows may have any stride: q/k/v are column slices of the fused qkv projection.
``load_native_ops(cache_dir)`` compiles/loads the library (``build.py``); callers decide what to do when
it raises ``NativeBuildError`` (the engine falls back to PyTorch ops for ``native_cpu_ops="auto"``).
"""

from __future__ import annotations

import ctypes
import itertools
from pathlib import Path

import torch

from kvpilot.engine.kv.kv_quant import KVQuant
from kvpilot.engine.native.build import load_library
from kvpilot.engine.native.decode_step_ops import DecodeStepKernels
from kvpilot.engine.native.kv_args import kv_cache_args
from kvpilot.engine.native.quant_ops import QuantKernels, check_float_rows
from kvpilot.engine.native.sampling_ops import SamplingKernels
from kvpilot.engine.native.vnni_ops import VnniKernels

_P = ctypes.c_void_p
_I = ctypes.c_int64
_F = ctypes.c_float
_T = ctypes.c_int
#: the KV cache's kind, row scales and per-tensor scales (``kv_args.kv_cache_args``)
_KV = (_T, _P, _P, _F, _F)
_SIGNATURES = {
    "kvp_add_rms_norm": (_P, _I, _P, _I, _P, _P, _I, _I, _F, _T),
    "kvp_rope_inplace": (_P, _I, _I, _I, _I, _I, _P, _P, _P, _T),
    "kvp_write_kv": (_P, _I, _P, _I, _P, _P, _P, _I, _I, _I, _I, _T, _P, _P, _F, _F, _T),
    "kvp_silu_mul": (_P, _P, _I, _I, _T),
    "kvp_gelu_tanh_mul": (_P, _P, _I, _I, _T),
    "kvp_paged_decode": (_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I, _F, *_KV, _T),
    "kvp_linear": (_P, _I, _P, _P, _P, _I, _I, _I, _T),
    "kvp_paged_prefill": (_P, _P, _I, _P, _P, _P, _I, _P, _P, _I, _I, _I, _I, _I, _F, _I, _F, *_KV, _T),
}
#: output columns per panel of ``linear``'s packed weight layout (small_gemm.c's PANEL)
LINEAR_PANEL = 16
#: limits of the attention kernels' per-task buffers
MAX_GROUP = 64
MAX_HEAD_DIM = 256
#: ``paged_prefill`` multiplies 16-column tiles of V, so head_dim must be a multiple of this
PREFILL_HEAD_DIM_MULTIPLE = 16


def _rows(x: torch.Tensor, name: str, width: int | None = None) -> int:
    """Row stride of a 2-D float32 CPU tensor whose rows are contiguous."""
    check_float_rows(x, name, width)
    return x.stride(0)


def _contiguous(x: torch.Tensor, name: str, dtype: torch.dtype) -> None:
    if x.dtype != dtype or x.device.type != "cpu" or not x.is_contiguous():
        raise ValueError(f"{name} must be a contiguous {dtype} CPU tensor, got {x.dtype} {tuple(x.shape)}")


def _paged_attention_layout(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    head_dim_multiple: int,
) -> tuple[int, int, int]:
    """Checks the attention kernels share (query rows, GQA group, head size, caches, block table dtype and
    layout); returns the query row stride, the query heads and the head size."""
    _, kv_heads, _, head_dim = key_cache.shape
    num_heads = query.shape[1] // head_dim if query.dim() == 2 else 0
    qs = _rows(query, "query", num_heads * head_dim)
    if (
        not num_heads
        or num_heads % kv_heads
        or num_heads // kv_heads > MAX_GROUP
        or head_dim > MAX_HEAD_DIM
        or head_dim % head_dim_multiple
    ):
        multiple = f"a multiple of {head_dim_multiple} " if head_dim_multiple > 1 else ""
        raise ValueError(
            f"{num_heads} query heads over {kv_heads} KV heads of size {head_dim} "
            f"(group <= {MAX_GROUP}, head_dim {multiple}<= {MAX_HEAD_DIM})"
        )
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be int32 [sequences, max_blocks] with contiguous rows")
    return qs, num_heads, head_dim


def check_block_tables(block_tables: torch.Tensor, longest: int, key_cache: torch.Tensor) -> None:
    """Every sequence fits its table row (``longest`` tokens) and every block id names a cache block."""
    num_blocks, _, block_size, _ = key_cache.shape
    if longest > block_tables.shape[1] * block_size:
        raise ValueError("a sequence is longer than its block table covers")
    if not 0 <= int(block_tables.min()) <= int(block_tables.max()) < num_blocks:
        raise ValueError(f"block ids must lie in [0, {num_blocks})")


class NativeOps:
    """The loaded kernels. Every method works in place or on an ``out`` it allocates, as documented."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib
        for name, argtypes in _SIGNATURES.items():
            getattr(lib, name).argtypes = argtypes
            getattr(lib, name).restype = None
        lib.kvp_has_avx2.restype = ctypes.c_int
        # 0, or -1 when their scratch memory was not allocated
        lib.kvp_paged_prefill.restype = ctypes.c_int
        lib.kvp_paged_decode.restype = ctypes.c_int
        #: whether ``linear`` has its vector kernel (else a scalar loop: callers should keep their GEMM)
        self.has_fast_linear = bool(lib.kvp_has_avx2())
        #: whether ``paged_prefill`` has its kernel (AVX2; else callers keep their own prefill attention)
        self.has_prefill_attention = self.has_fast_linear
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
        rs = _rows(residual, "residual")
        ds = 0 if delta is None else _rows(delta, "delta", hidden)
        if delta is not None and delta.shape[0] != tokens:
            raise ValueError(f"delta has {delta.shape[0]} rows, residual {tokens}")
        _contiguous(weight, "weight", torch.float32)
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
        xs = _rows(x, "x")
        rotary = cos.shape[1] if cos.dim() == 2 else 0
        if x.shape[1] < num_heads * head_dim or rotary % 2 or not 0 < rotary <= head_dim:
            raise ValueError(
                f"x rows ({x.shape[1]}) must hold {num_heads} heads of {head_dim}, each rotated over an even "
                f"number of dims up to {head_dim} (the tables' width, {rotary})"
            )
        _contiguous(positions, "positions", torch.int64)
        for table, name in ((cos, "cos"), (sin, "sin")):
            _contiguous(table, name, torch.float32)
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
        ks, vs = _rows(key, "key", kv_heads * head_dim), _rows(value, "value", kv_heads * head_dim)
        kv = kv_cache_args(key_cache, value_cache, quant)
        _contiguous(slots, "slots", torch.int64)
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

    def _gated(self, kernel, gate_up: torch.Tensor) -> torch.Tensor:
        _contiguous(gate_up, "gate_up", torch.float32)
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
        _contiguous(weight, "weight", torch.float32)
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
        xs = _rows(x, "x")
        _contiguous(packed_weight, "packed_weight", torch.float32)
        panels = -(-out_features // LINEAR_PANEL)
        if packed_weight.shape != (panels, x.shape[1], LINEAR_PANEL):
            raise ValueError(
                f"packed_weight must be [{panels}, {x.shape[1]}, {LINEAR_PANEL}] for {out_features} "
                f"outputs of {x.shape[1]} inputs, got {tuple(packed_weight.shape)}"
            )
        if bias is not None:
            _contiguous(bias, "bias", torch.float32)
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

    def paged_decode(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        quant: KVQuant | None = None,
    ) -> torch.Tensor:
        """Attention of each sequence's one new query (``query`` ``[B, Hq * D]`` rows) over its paged
        context, reading K/V blocks in place; returns ``[B, Hq, D]``. ``softcap`` soft-caps the scaled
        scores (``cap * tanh(s / cap)``); ``quant`` says how a quantized cache's codes read."""
        batch = query.shape[0]
        qs, num_heads, head_dim = _paged_attention_layout(query, key_cache, value_cache, block_tables, 1)
        kv = kv_cache_args(key_cache, value_cache, quant)
        _, kv_heads, block_size, _ = key_cache.shape
        _contiguous(seq_lens, "seq_lens", torch.int32)
        if block_tables.shape[0] < batch or seq_lens.numel() < batch:
            raise ValueError(
                f"{batch} queries but {block_tables.shape[0]} block tables, {seq_lens.numel()} lengths"
            )
        if batch:
            check_block_tables(block_tables[:batch], int(seq_lens[:batch].max()), key_cache)
        out = torch.empty(batch, num_heads, head_dim)
        status = self._lib.kvp_paged_decode(
            out.data_ptr(),
            query.data_ptr(),
            qs,
            key_cache.data_ptr(),
            value_cache.data_ptr(),
            block_tables.data_ptr(),
            block_tables.stride(0),
            seq_lens.data_ptr(),
            batch,
            num_heads,
            kv_heads,
            head_dim,
            block_size,
            scale,
            sliding_window or 0,
            softcap or 0.0,
            *kv,
            self._threads(),
        )
        if status:
            raise MemoryError("paged_decode could not allocate its row buffers")
        return out

    def paged_prefill(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        sliding_window: int | None,
        softcap: float | None = None,
        quant: KVQuant | None = None,
    ) -> torch.Tensor:
        """Causal attention of prefill/extend tokens over their paged context (their own K/V already
        written): sequence ``s`` owns query rows ``[query_start_loc[s], query_start_loc[s + 1])`` (``query``
        ``[rows, Hq * D]``), the last of its ``seq_lens[s]`` positions, and block table row ``s``. Returns
        ``[query_start_loc[-1] - query_start_loc[0], Hq, D]``; ``softcap`` and ``quant`` as in
        ``paged_decode``. Needs ``has_prefill_attention``."""
        if not self.has_prefill_attention:
            raise ValueError("paged_prefill needs AVX2; keep the PyTorch attention on this CPU")
        qs, num_heads, head_dim = _paged_attention_layout(
            query, key_cache, value_cache, block_tables, PREFILL_HEAD_DIM_MULTIPLE
        )
        kv = kv_cache_args(key_cache, value_cache, quant)
        _, kv_heads, block_size, _ = key_cache.shape
        _contiguous(query_start_loc, "query_start_loc", torch.int32)
        _contiguous(seq_lens, "seq_lens", torch.int32)
        seqs = seq_lens.numel()
        if query_start_loc.numel() != seqs + 1 or block_tables.shape[0] != seqs:
            raise ValueError(
                f"{seqs} sequences need {seqs + 1} query offsets and {seqs} block tables, got "
                f"{query_start_loc.numel()} and {block_tables.shape[0]}"
            )
        starts = query_start_loc.tolist()
        q_lens = [b - a for a, b in itertools.pairwise(starts)]
        if seqs and (starts[0] < 0 or starts[-1] > query.shape[0] or min(q_lens) < 0):
            raise ValueError(f"query offsets must rise within the {query.shape[0]} query rows, got {starts}")
        lens = seq_lens.tolist()
        if any(n > length for n, length in zip(q_lens, lens, strict=True)):
            raise ValueError("a sequence has more new tokens than its length")
        if seqs:
            check_block_tables(block_tables, max(lens), key_cache)
        out = torch.empty(starts[-1] - starts[0] if seqs else 0, num_heads, head_dim)
        if seqs:
            status = self._lib.kvp_paged_prefill(
                out.data_ptr(),
                query.data_ptr(),
                qs,
                key_cache.data_ptr(),
                value_cache.data_ptr(),
                block_tables.data_ptr(),
                block_tables.stride(0),
                query_start_loc.data_ptr(),
                seq_lens.data_ptr(),
                seqs,
                num_heads,
                kv_heads,
                head_dim,
                block_size,
                scale,
                sliding_window or 0,
                softcap or 0.0,
                *kv,
                self._threads(),
            )
            if status:
                raise MemoryError("paged_prefill could not allocate its scratch buffers")
        return out


def load_native_ops(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> NativeOps:
    return NativeOps(load_library(cache_dir, extra_flags))
