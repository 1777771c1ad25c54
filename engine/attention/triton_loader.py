"""Loading the Triton kernels for a device: compiled on CUDA, run by the Triton interpreter on CPU.

Triton decides per kernel, when its module is imported, whether to compile it or interpret it (the
``TRITON_INTERPRET`` environment variable at that moment). ``load_kernels`` therefore owns the import of
the kernel modules: for a CPU device it sets ``TRITON_INTERPRET=1`` first, and refuses with a clear
error when something already imported them for compilation. Nothing here imports triton or the kernels
at import time.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from dataclasses import dataclass
from types import ModuleType

import torch

_KERNEL_PACKAGE = "kvpilot.engine.attention.kernels"
#: modules that define @triton.jit functions, in import order
_JIT_MODULES = ("kv_codes", "tile_ops", "split_kv", "kv_write", "decode", "prefill")
#: values of TRITON_INTERPRET that Triton reads as "on"
_TRUTHY = ("1", "true", "on")


def _interpreter_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in _TRUTHY


@dataclass(frozen=True)
class TritonKernels:
    tile_ops: ModuleType
    kv_write: ModuleType
    decode: ModuleType
    prefill: ModuleType
    split_kv: ModuleType
    tuning: ModuleType
    warmup: ModuleType
    interpreted: bool


def load_kernels(device: torch.device) -> TritonKernels:
    """Import the kernel modules for ``device``: compiled for CUDA, interpreted for CPU."""
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"the Triton backend runs on CUDA, or on CPU in the interpreter; got {device}")
    names = [f"{_KERNEL_PACKAGE}.{name}" for name in _JIT_MODULES]
    if device.type == "cpu" and not _interpreter_requested():
        imported = [name for name in names if name in sys.modules]
        if imported:
            raise RuntimeError(
                f"Triton kernels {imported} were imported for GPU compilation (TRITON_INTERPRET unset); "
                "on CPU they only run in the Triton interpreter. Set TRITON_INTERPRET=1 before anything "
                "imports them (or construct the Triton backend for CPU first)."
            )
        os.environ["TRITON_INTERPRET"] = "1"
    modules = {
        name: importlib.import_module(f"{_KERNEL_PACKAGE}.{name}")
        for name in (*_JIT_MODULES, "tuning", "warmup")
    }
    tile_ops = modules["tile_ops"]
    jit_functions = (
        modules["kv_codes"].fp8_e4m3_to_float,
        tile_ops.load_kv_tile,
        modules["split_kv"].merge_splits_kernel,
        modules["kv_write"].kv_write_kernel,
        modules["decode"].paged_decode_kernel,
        modules["prefill"].paged_prefill_kernel,
    )
    interpreted = [tile_ops.runs_in_interpreter(fn) for fn in jit_functions]
    if device.type == "cpu" and not all(interpreted):
        raise RuntimeError(
            "some Triton kernels were imported before TRITON_INTERPRET=1 was set and are "
            "compiled for a GPU; set TRITON_INTERPRET=1 before importing them to run on CPU"
        )
    if device.type == "cuda" and any(interpreted):
        warnings.warn(
            "TRITON_INTERPRET=1 is set: the Triton kernels run in the (slow) interpreter on CUDA "
            "tensors; unset it to compile them",
            RuntimeWarning,
            stacklevel=2,
        )
    return TritonKernels(
        tile_ops,
        modules["kv_write"],
        modules["decode"],
        modules["prefill"],
        modules["split_kv"],
        modules["tuning"],
        modules["warmup"],
        interpreted=all(interpreted),
    )
