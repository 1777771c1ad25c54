"""What the operator knows of a model's size, and the pod memory that loading it needs at the least.

Only the models the engine knows by name have a known size: a path or a PVC is opaque to the operator
(it never reads the volume), so for those every function here answers None and the spec's values stand.
"""

from __future__ import annotations

# Parameter counts of the models the engine knows by name.
KNOWN_MODEL_PARAMETERS = {"smollm2-135m": 135_000_000, "tiny-random": 1_000_000}
BYTES_PER_PARAMETER = {"float32": 4, "float16": 2, "bfloat16": 2}
# Interpreter, torch and the HTTP server before any weights: `kvpilot serve --model tiny-random` peaks at
# 289 MB RSS on CPU (2026-12), so 256 MiB is a floor, not an estimate.
ENGINE_RUNTIME_BYTES = 256 * 1024 * 1024


def engine_dtype(dtype: str, on_gpu: bool) -> str:
    """The dtype the engine loads: ``auto`` is float32 on CPU and bfloat16 on CUDA (as its loader says)."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if on_gpu else "float32"


def weight_bytes(source: str, dtype: str) -> int | None:
    """Bytes of the weights in ``dtype`` (not ``auto``), or None for a model of unknown size."""
    parameters = KNOWN_MODEL_PARAMETERS.get(source)
    return None if parameters is None else parameters * BYTES_PER_PARAMETER[dtype]


def memory_floor_bytes(source: str, dtype: str, on_gpu: bool, kv_cache_bytes: int) -> int | None:
    """Pod memory below which loading certainly fails, or None when the model's size is unknown.

    On CPU the weights and the KV cache (``kv_cache_bytes``) stay in the pod's memory. On GPU the KV
    cache is on the device, but the engine reads the checkpoint into host memory before it moves it to
    the GPU (``engine/model/loader.py``), so the weights count there too; once loading streams tensor by
    tensor (issue 19, item 6) that term can shrink to one tensor.
    """
    weights = weight_bytes(source, engine_dtype(dtype, on_gpu))
    if weights is None:
        return None
    return weights + (0 if on_gpu else kv_cache_bytes) + ENGINE_RUNTIME_BYTES
