"""How many KV blocks the engine allocates and how long a context it accepts
(docs/architecture.md#kv-cache-sizing)."""

from __future__ import annotations

import logging

import torch

from kvpilot.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, CacheConfig, ConfigError
from kvpilot.engine.kv.capacity import num_blocks_for_memory

log = logging.getLogger(__name__)


def kv_cache_sizing(cache: CacheConfig, device: torch.device) -> str:
    """How the KV cache is sized: ``num_kv_blocks``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``
    (a profiled budget on CUDA) or ``cpu_default`` (1 GiB)."""
    if cache.num_kv_blocks is not None:
        return "num_kv_blocks"
    if cache.kv_cache_memory_bytes is not None:
        return "kv_cache_memory_bytes"
    return "gpu_memory_utilization" if device.type == "cuda" else "cpu_default"


def plan_num_kv_blocks(cache: CacheConfig, bytes_per_token: int, profiled_budget: int | None = None) -> int:
    """``num_kv_blocks`` if given, else the memory budget (explicit ``kv_cache_memory_bytes``, the profiled
    ``gpu_memory_utilization`` budget on CUDA, or 1 GiB on CPU) divided by the bytes of one block."""
    if cache.num_kv_blocks is not None:
        return cache.num_kv_blocks
    budget = cache.kv_cache_memory_bytes
    if budget is None:
        budget = profiled_budget if profiled_budget is not None else DEFAULT_CPU_KV_CACHE_BYTES
    blocks = num_blocks_for_memory(budget, bytes_per_token, cache.block_size)
    if blocks < 2:
        raise ConfigError(
            f"KV budget of {budget} bytes holds {blocks} blocks of {cache.block_size} tokens "
            f"({bytes_per_token} bytes/token); need at least 2"
        )
    return blocks


def plan_max_model_len(wanted: int | None, model_limit: int, capacity_tokens: int) -> int:
    """The context limit: the requested one if the model and the KV cache allow it, else the smaller of
    the model's limit and what the KV cache can hold for one sequence."""
    if wanted is not None:
        if wanted > model_limit:
            raise ConfigError(
                f"max_model_len {wanted} exceeds the model's max_position_embeddings {model_limit}"
            )
        if wanted > capacity_tokens:
            raise ConfigError(
                f"max_model_len {wanted} exceeds the KV cache capacity of {capacity_tokens} "
                "tokens; raise num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        return wanted
    if capacity_tokens < model_limit:
        log.info("max_model_len limited by the KV cache to %d tokens", capacity_tokens)
    return min(model_limit, capacity_tokens)
