"""Tensor wrapper of the sampling kernel (``sampling.c``; its reference is the PyTorch pipeline in
``kvpilot.engine.sampling``: ``Sampler`` with the kernel off).

``SamplingKernels.draw`` takes the rows that sample after the pipeline's steps 1-2 (constraints and
penalties, still on the tensors), their parameters as ``SamplingTensors.values`` and one uniform number
each, and returns the drawn token ids: steps 3-5 (temperature, min-p, top-k, top-p, the inverse-CDF draw)
in one pass per row. Rows with typical-p or a temperature below ``NEAR_ZERO_TEMPERATURE`` stay on the
reference (``Sampler`` checks that on the host); so does anything that needs the processed distribution
itself (processed logprobs, beams). On 128 rows of a 49k vocabulary this replaces ~130 ms of tensor ops on
one thread (``bench/results/step_profile.md``).
"""

from __future__ import annotations

import ctypes

import torch

from kvpilot.engine.native.tensor_checks import check_float_rows

#: columns of the parameter rows the kernel reads (``row_params.COLUMNS``)
PARAM_COLUMNS = 5


class SamplingKernels:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.kvp_sample_rows
        self._fn.argtypes = (
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int,
        )
        self._fn.restype = ctypes.c_int

    def draw(self, logits: torch.Tensor, params: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        """int64 token ids [N] for ``logits`` [N, V] (float32, contiguous rows), ``params`` [N, 5] float32
        (temperature > 0, min_p, top_k, top_p, typical_p = 1) and ``uniforms`` [N] float32 in [0, 1)."""
        check_float_rows(logits, "logits")
        rows, vocab = logits.shape
        if (
            params.dtype != torch.float32
            or not params.is_contiguous()
            or params.shape != (rows, PARAM_COLUMNS)
        ):
            raise ValueError(
                f"params must be contiguous float32 [{rows}, {PARAM_COLUMNS}], got {params.shape}"
            )
        if uniforms.dtype != torch.float32 or not uniforms.is_contiguous() or uniforms.shape != (rows,):
            raise ValueError(f"uniforms must be contiguous float32 [{rows}], got {tuple(uniforms.shape)}")
        if vocab >= 1 << 31:
            raise ValueError(f"a vocabulary of {vocab} tokens does not fit the kernel's int32 token ids")
        tokens = torch.empty(rows, dtype=torch.int64)
        if rows:
            status = self._fn(
                logits.data_ptr(),
                rows,
                vocab,
                logits.stride(0),
                params.data_ptr(),
                uniforms.data_ptr(),
                tokens.data_ptr(),
                torch.get_num_threads(),
            )
            if status != 0:
                raise MemoryError(f"the sampling kernel could not allocate its scratch for {vocab} tokens")
        return tokens
