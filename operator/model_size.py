"""What the operator knows of a model's size: the pod memory that loading it needs at the least, and the
scratch volume its conversion needs.

Only the models the engine knows by name have a known size: a path, a PVC or a fetched file is opaque to
the operator (it never reads them), so for those the functions here answer None or a default, and the
spec's values stand.
"""

from __future__ import annotations

# Parameter counts of the models the engine knows by name.
KNOWN_MODEL_PARAMETERS = {"smollm2-135m": 135_000_000, "tiny-random": 1_000_000}
BYTES_PER_PARAMETER = {"float32": 4, "float16": 2, "bfloat16": 2}
# Interpreter, torch and the HTTP server before any weights: `kvpilot serve --model tiny-random` peaks at
# 289 MB RSS on CPU (2026-12), so 256 MiB is a floor, not an estimate.
ENGINE_RUNTIME_BYTES = 256 * 1024 * 1024
# The known models are written into the pod's model cache as float32 safetensors (GGUF conversion, the
# seeded tiny model), in shards of at most this size (engine/model/gguf_convert.py's default).
CONVERSION_SHARD_BYTES = 2 * 1024**3
# The scratch volume holds, beside a known model's float32 conversion, the tokenizer the router extracts,
# the native and Triton kernel caches and the engine's own files.
SCRATCH_HEADROOM_BYTES = 1024**3
DEFAULT_SCRATCH = "10Gi"  # sources of unknown size, when model.cacheSize is unset


#: (attention heads, KV heads, MLP width) of the models the engine knows by name: what tensor
#: parallelism must divide (the engine's ``distributed.sharding.check_tensor_parallel`` rules)
KNOWN_MODEL_SHAPES = {"smollm2-135m": (9, 3, 1536), "tiny-random": (4, 2, 128)}


def tensor_parallel_problem(source: str, gpus: int) -> str | None:
    """Why a model of known shape cannot be split over ``gpus`` ranks, or None (it can, or its shape is
    unknown: the engine checks it at start)."""
    shape = KNOWN_MODEL_SHAPES.get(source)
    if shape is None or gpus <= 1:
        return None
    heads, kv, width = shape
    if heads % gpus:
        fits = [d for d in range(1, heads + 1) if heads % d == 0]
        return f"{source} has {heads} attention heads, which {gpus} GPUs do not divide (use one of {fits})"
    if kv % gpus and gpus % kv:
        return f"{source} has {kv} KV heads: {gpus} GPUs must divide them or be a multiple of them"
    if width % gpus:
        return f"{source}'s MLP width {width} does not split over {gpus} GPUs"
    return None


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

    On CPU the weights and the KV cache (``kv_cache_bytes``) stay in the pod's memory. On GPU both are on
    the device (the loader streams the weights tensor by tensor), but the known models are first written
    into the model cache as float32, one shard at a time, so the host holds up to one float32 shard.
    """
    if on_gpu:
        converted = weight_bytes(source, "float32")
        return None if converted is None else min(converted, CONVERSION_SHARD_BYTES) + ENGINE_RUNTIME_BYTES
    weights = weight_bytes(source, engine_dtype(dtype, on_gpu))
    if weights is None:
        return None
    return weights + kv_cache_bytes + ENGINE_RUNTIME_BYTES


def scratch_quantity(source: str, cache_size: str | None) -> str:
    """The scratch emptyDir's size: ``cache_size`` if set, a known model's conversion plus headroom, or
    ``DEFAULT_SCRATCH``."""
    if cache_size is not None:
        return cache_size
    converted = weight_bytes(source, "float32")
    if converted is None:
        return DEFAULT_SCRATCH
    return f"{-(-(converted + SCRATCH_HEADROOM_BYTES) // 2**20)}Mi"
