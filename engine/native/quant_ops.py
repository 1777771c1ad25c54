"""Tensor wrapper of the quantized GEMM (``quant_gemm.c``; its PyTorch reference:
``reference.reference_quant_linear``).

A quantized weight is ``data``: uint8 ``[out_features, row_bytes]``, each row the blocks of one output
feature exactly as llama.cpp stores them (``Q4_0``, ``Q4_1``, ``Q8_0``: 32 weights per block, an fp16 scale
first), or for ``int8`` ``in_features`` signed bytes per row with a float32 ``scales[out_features]``
(docs/architecture.md#quantized-weights). ``QuantKernels.linear`` checks all of that before calling C.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from kvpilot.engine.native.tensor_checks import check_float_rows

#: weights per block, in every format (an int8 row is read in chunks of this many)
BLOCK = 32


@dataclass(frozen=True)
class QuantFormat:
    name: str
    #: quant_gemm.c's format number
    code: int
    #: bytes per block of ``block_weights`` weights
    block_bytes: int
    #: True: one float32 scale per output row beside the data (int8); False: fp16 scales inside each block
    row_scales: bool
    #: weights per block: 32, or 256 for the K-quants' super-blocks (eight 32-weight sub-blocks, their
    #: scales packed in the super-block's header)
    block_weights: int = BLOCK

    def row_bytes(self, in_features: int) -> int:
        if self.row_scales:
            return in_features
        if in_features % self.block_weights:
            raise ValueError(
                f"{self.name} rows hold blocks of {self.block_weights} weights; "
                f"{in_features} inputs do not fit"
            )
        return in_features // self.block_weights * self.block_bytes


#: the formats the kernels run, by name (GGUF's type names; ``int8`` is kvpilot's own). Q4_K and Q6_K are
#: what llama.cpp's Q4_K_M / Q6_K files hold (their layout: ``quant_blocks.h``).
FORMATS = {
    f.name: f
    for f in (
        QuantFormat("Q4_0", 0, 18, False),
        QuantFormat("Q4_1", 1, 20, False),
        QuantFormat("Q8_0", 2, 34, False),
        QuantFormat("int8", 3, BLOCK, True),
        QuantFormat("Q4_K", 4, 144, False, 256),
        QuantFormat("Q6_K", 5, 210, False, 256),
    )
}
#: the K-quants (256-weight super-blocks)
K_FORMATS = frozenset(name for name, f in FORMATS.items() if f.block_weights > BLOCK)


def check_vector(v: torch.Tensor, name: str, length: int) -> None:
    """``v`` must be a contiguous float32 CPU tensor of ``length`` (a bias, int8 rows' scales)."""
    if v.dtype != torch.float32 or v.device.type != "cpu" or not v.is_contiguous() or v.shape != (length,):
        raise ValueError(
            f"{name} must be a contiguous float32 CPU tensor [{length}], got {v.dtype} {tuple(v.shape)}"
        )


class QuantKernels:
    """``linear`` on the loaded library (the one ``ops.NativeOps`` holds)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvp_quant_linear
        self._fn.argtypes = (
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
        )
        self._fn.restype = ctypes.c_int
        self._dequantize = lib.kvp_quant_dequantize
        self._dequantize.argtypes = (
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int,
        )
        self._dequantize.restype = ctypes.c_int
        lib.kvp_quant_has_avx2.restype = ctypes.c_int
        #: whether the AVX2/FMA kernels were compiled in (else a scalar loop: correct, several times slower)
        self.vectorized = bool(lib.kvp_quant_has_avx2())

    def linear(
        self,
        x: torch.Tensor,
        data: torch.Tensor,
        scales: torch.Tensor | None,
        fmt: str,
        bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for ``x`` ``[M, K]`` and the quantized ``W`` (``data``, ``scales``, format
        ``fmt``; see the module docstring); returns a new ``[M, N]`` float32 tensor."""
        check_float_rows(x, "x")
        rows, in_features = x.shape
        form = check_weight(data, scales, fmt, in_features)
        out_features = data.shape[0]
        if bias is not None:
            check_vector(bias, "bias", out_features)
        out = torch.empty(rows, out_features)
        status = self._fn(
            x.data_ptr(),
            x.stride(0),
            data.data_ptr(),
            None if scales is None else scales.data_ptr(),
            form.code,
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows,
            out_features,
            in_features,
            torch.get_num_threads(),
        )
        if status:
            raise ValueError(f"kvp_quant_linear refused format code {form.code}")
        return out

    def dequantize(
        self, data: torch.Tensor, scales: torch.Tensor | None, fmt: str, in_features: int, out: torch.Tensor
    ) -> torch.Tensor:
        """The weight as float32 into ``out`` (contiguous ``[N, in_features]``); returns ``out``."""
        form = check_weight(data, scales, fmt, in_features)
        if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != (data.shape[0], in_features):
            raise ValueError(f"out must be a contiguous float32 [{data.shape[0]}, {in_features}] tensor")
        self._dequantize(
            data.data_ptr(),
            None if scales is None else scales.data_ptr(),
            form.code,
            out.data_ptr(),
            data.shape[0],
            in_features,
            torch.get_num_threads(),
        )
        return out


def check_weight(data: torch.Tensor, scales: torch.Tensor | None, fmt: str, in_features: int) -> QuantFormat:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; the kernels run {sorted(FORMATS)}")
    form = FORMATS[fmt]
    out_features = data.shape[0] if data.dim() == 2 else 0
    row_bytes = form.row_bytes(in_features)
    if data.dtype != torch.uint8 or not data.is_contiguous() or data.shape != (out_features, row_bytes):
        raise ValueError(
            f"{fmt} data for {in_features} inputs must be contiguous uint8 [out, {row_bytes}], got "
            f"{data.dtype} {tuple(data.shape)}"
        )
    if form.row_scales:
        if scales is None:
            raise ValueError(f"{fmt} needs one float32 scale per output row")
        check_vector(scales, "scales", out_features)
    elif scales is not None:
        raise ValueError(f"{fmt} keeps its scales inside the blocks; scales must be None")
    return form
