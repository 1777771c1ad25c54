"""Warm-up tuning: time the attention kernels' candidate configurations on the shapes an engine serves.

Runs on CUDA only, before the engine reports ready. It reads the engine's real caches (attention only
reads them, so their contents do not matter) through synthetic block tables that cycle over the
non-reserved blocks, so it needs no extra KV memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpilot.engine.attention.kernels.decode import paged_decode
from kvpilot.engine.attention.kernels.launch_math import cdiv
from kvpilot.engine.attention.kernels.prefill import paged_prefill
from kvpilot.engine.attention.kernels.split_kv import allocate_partials, plan_kv_splits
from kvpilot.engine.attention.kernels.tuning import ConfigTable, decode_candidates, prefill_candidates

#: longest decode context timed: long enough to be bandwidth bound, short enough to tune in seconds
DECODE_TUNING_CONTEXT = 2048
#: decode batches beyond this behave alike (enough programs to fill the GPU)
DECODE_TUNING_BATCH = 64
#: longest prefill chunk timed
PREFILL_TUNING_TOKENS = 2048


def shape_key(
    head_dim: int, query_group: int, block_size: int, dtype: torch.dtype, has_window: bool
) -> tuple:
    """What a kernel's best configuration depends on (the batch and lengths do not change it much)."""
    return (head_dim, query_group, block_size, str(dtype).removeprefix("torch."), has_window)


def _cycling_block_tables(
    num_seqs: int, seq_len: int, block_size: int, num_blocks: int, device: torch.device
) -> torch.Tensor:
    blocks_per_seq = cdiv(seq_len, block_size)
    ids = torch.arange(num_seqs * blocks_per_seq, device=device) % (num_blocks - 1) + 1  # block 0 reserved
    return ids.view(num_seqs, blocks_per_seq).to(torch.int32)


def _measure_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench  # CUDA-only timing; imported when a GPU is being tuned

    return do_bench(fn, warmup=5, rep=20)


def tune_served_shapes(
    configs: ConfigTable,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    sliding_window: int | None,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int,
    num_sms: int,
) -> None:
    """Tune decode and prefill for this cache's shape class and record the choices in ``configs``."""
    if key_cache.device.type != "cuda":
        raise ValueError("warm-up tuning times kernels on a GPU; the interpreter uses the defaults")
    if min(max_num_seqs, max_num_batched_tokens, max_model_len) < 1:
        raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be positive")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    if num_blocks < 2:
        raise ValueError("the KV cache needs at least one block besides the reserved block 0")
    device, dtype = key_cache.device, key_cache.dtype
    key = shape_key(head_dim, num_heads // num_kv_heads, block_size, dtype, sliding_window is not None)

    batch = min(max_num_seqs, DECODE_TUNING_BATCH)
    context = min(max_model_len, DECODE_TUNING_CONTEXT)
    block_tables = _cycling_block_tables(batch, context, block_size, num_blocks, device)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    query = torch.randn(batch, num_heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(query)
    active = min(context, sliding_window) if sliding_window else context
    plan = plan_kv_splits([active] * batch, num_kv_heads, num_sms)
    splits = plan.num_kv_splits
    partials = allocate_partials(batch, num_heads, splits, head_dim, device) if splits > 1 else None
    configs.tune(
        "decode",
        key,
        decode_candidates(head_dim),
        lambda config: paged_decode(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            scale,
            sliding_window,
            splits,
            partials,
            config,
            min_split_tokens=plan.min_split_tokens,
        ),
        _measure_ms,
    )

    tokens = min(max_num_batched_tokens, max_model_len, PREFILL_TUNING_TOKENS)
    block_tables = _cycling_block_tables(1, tokens, block_size, num_blocks, device)
    seq_lens = torch.tensor([tokens], dtype=torch.int32, device=device)
    query_start_loc = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    query = torch.randn(tokens, num_heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(query)
    configs.tune(
        "prefill",
        key,
        prefill_candidates(head_dim),
        lambda config: paged_prefill(
            out,
            query,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            tokens,
            scale,
            sliding_window,
            config,
        ),
        _measure_ms,
    )
