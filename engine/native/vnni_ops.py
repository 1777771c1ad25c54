"""Tensor wrapper of the int8-activation GEMM (``quant_vnni.c`` on AVX-512 VNNI, ``quant_vnni_avx2.c`` on
AVX2 without it; their PyTorch reference: ``reference.reference_vnni_linear``).

A ``QuantLinear`` on this kernel (``activation_quantization='int8'``) keeps a ``VnniWeight``: its stored
blocks repacked once into tiles of 16 output rows x 32 inputs, codes and fp16 scales, as vpdpbusd reads
them (the layout is ``quant_tiles.h``'s: ``kvp_vnni_packed_bytes`` sizes it). Each call rounds the activations
to int8 per 32-input block (llama.cpp's scheme for its CPU kernels), so results differ from the float32
path by that rounding (docs/architecture.md#quantized-weights).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvpilot.engine.native.quant_ops import BLOCK, FORMATS, check_vector, check_weight
from kvpilot.engine.native.tensor_checks import check_float_rows


@dataclass(frozen=True)
class VnniWeight:
    """A weight in the kernel's packed layout: ``packed`` uint8, ``kind`` 4 (nibble codes: Q4_0, Q4_1,
    Q4_K) or 8 (byte codes: Q8_0, int8)."""

    packed: torch.Tensor
    kind: int
    out_features: int
    in_features: int


class VnniKernels:
    """``pack``, ``linear`` and ``quantize`` on the loaded library (the one ``ops.NativeOps`` holds)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        v, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._kind = lib.kvp_vnni_kind
        self._kind.argtypes, self._kind.restype = (i,), i
        self._packed_bytes = lib.kvp_vnni_packed_bytes
        self._packed_bytes.argtypes, self._packed_bytes.restype = (i, i64, i64), i64
        self._pack = lib.kvp_vnni_pack
        self._pack.argtypes, self._pack.restype = (v, v, i, v, i64, i64, i), i64
        self._linear = lib.kvp_vnni_linear
        self._linear.argtypes, self._linear.restype = (v, i64, v, i, v, v, i64, i64, i64, i), i
        self._quantize = lib.kvp_vnni_quantize
        self._quantize.argtypes, self._quantize.restype = (v, i64, v, v, v, i64, i64), None
        lib.kvp_vnni_available.restype = i
        level = lib.kvp_vnni_available()
        #: the instruction set this build's kernel uses: ``avx512-vnni``, ``avx2`` or None (no kernel)
        self.isa = {2: "avx512-vnni", 1: "avx2"}.get(level)
        #: whether this build has the kernel (the CPU has AVX-512 VNNI and BW, or AVX2, FMA and F16C)
        self.available = self.isa is not None

    def packable(self, fmt: str, in_features: int) -> bool:
        """Whether a ``fmt`` weight of ``in_features`` inputs runs here (Q6_K's scales change every 16
        weights, and the packed layout needs whole 32-input blocks)."""
        return self.available and fmt in FORMATS and self._packed_bytes(FORMATS[fmt].code, 1, in_features) > 0

    def pack(self, data: torch.Tensor, scales: torch.Tensor | None, fmt: str, in_features: int) -> VnniWeight:
        """The stored weight (``quant_ops``'s ``data``/``scales`` of format ``fmt``) repacked."""
        if not self.packable(fmt, in_features):
            raise ValueError(
                f"{fmt} weights of {in_features} inputs have no int8-activation kernel here "
                f"(kernel: {self.isa or 'none, no AVX2'}; formats Q4_0, Q4_1, Q4_K, Q8_0, int8; "
                "whole 32-input blocks)"
            )
        form = check_weight(data, scales, fmt, in_features)
        n = data.shape[0]
        packed = torch.empty(self._packed_bytes(form.code, n, in_features), dtype=torch.uint8)
        written = self._pack(
            data.data_ptr(),
            None if scales is None else scales.data_ptr(),
            form.code,
            packed.data_ptr(),
            n,
            in_features,
            torch.get_num_threads(),
        )
        if written != packed.numel():
            raise RuntimeError(f"kvp_vnni_pack wrote {written} bytes, expected {packed.numel()}")
        return VnniWeight(packed, self._kind(form.code), n, in_features)

    def linear(self, x: torch.Tensor, weight: VnniWeight, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ W.T + bias`` for float32 ``x`` ``[M, K]`` (contiguous rows), activations rounded to int8
        per 32-input block; returns a new ``[M, N]`` float32 tensor."""
        check_float_rows(x, "x", weight.in_features)
        n = weight.out_features
        if bias is not None:
            check_vector(bias, "bias", n)
        out = torch.empty(x.shape[0], n)
        status = self._linear(
            x.data_ptr(),
            x.stride(0),
            weight.packed.data_ptr(),
            weight.kind,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            x.shape[0],
            n,
            weight.in_features,
            torch.get_num_threads(),
        )
        if status == -2:
            raise MemoryError(f"kvp_vnni_linear could not allocate activations for {x.shape[0]} rows")
        if status:
            raise ValueError(f"kvp_vnni_linear refused layout kind {weight.kind}")
        return out

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's rounding of ``x`` [M, K] (K a multiple of 32): int8 codes [M, K], scales ``dx``
        and ``sx = dx * sum(codes)`` [M, K / 32]."""
        if not self.available:
            raise ValueError("this build has no int8-activation kernel (AVX-512 VNNI or AVX2)")
        check_float_rows(x, "x")
        m, k = x.shape
        if k % BLOCK:
            raise ValueError(f"x rows must hold whole blocks of {BLOCK}, got {k}")
        codes = torch.empty(m, k, dtype=torch.int8)
        dx, sx = torch.empty(m, k // BLOCK), torch.empty(m, k // BLOCK)
        self._quantize(x.data_ptr(), x.stride(0), codes.data_ptr(), dx.data_ptr(), sx.data_ptr(), m, k)
        return codes, dx, sx
