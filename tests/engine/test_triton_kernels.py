"""The Triton attention kernels against their PyTorch references, in the Triton interpreter.

Shapes are tiny (the interpreter runs every program in Python). The cases cover, between them: sequence
lengths 1, exact block multiples and partial last blocks; GQA groups 1/3/8; head_dim 64/128/256; block
sizes 16/32/64; key tiles smaller than, equal to and larger than a block; fp32/fp16/bf16 caches;
sliding windows (including a window of 1); split-KV with empty splits; prefix + extend; Gemma 2's
attention-logit soft-capping with and without a window.
"""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch

from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.kernels.tuning import KernelConfig
from kvpilot.engine.attention.triton_loader import load_kernels

pytestmark = pytest.mark.triton

KERNELS = load_kernels(DEVICE)
#: absolute tolerance of the output (values are convex combinations of N(0, 1) rows)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}

# lengths 1, block multiples (16, 32, 64) and partial last blocks for every block size used
DECODE_SEQ_LENS = [1, 16, 17, 32, 47, 64, 70]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not torch.isnan(actual).any(), "kernel output has NaN: it read an unused cache slot"
    torch.testing.assert_close(actual.float(), expected, atol=TOLERANCE[dtype], rtol=0)


# (dtype, head_dim, block_size, query_group, num_kv_heads, sliding_window, num_kv_splits, tile_n)
DECODE_CASES = [
    (torch.float32, 64, 16, 1, 2, None, 1, 32),
    (torch.float16, 128, 32, 3, 2, None, 3, 32),
    (torch.float16, 64, 64, 8, 1, None, 1, 16),
    (torch.bfloat16, 64, 16, 8, 1, None, 2, 64),
    (torch.float32, 256, 16, 3, 1, 20, 1, 16),
    (torch.float16, 64, 16, 1, 2, 20, 4, 16),
    (torch.float16, 64, 32, 3, 2, 1, 2, 32),
    (torch.float32, 64, 64, 8, 1, 33, 5, 16),
]


# soft-capped scores (cap 1.5: random scores of about N(0, 1) are bent well off the identity)
SOFTCAP_DECODE_CASES = [
    (torch.float32, 64, 16, 3, 2, None, 1, 32, 1.5),
    (torch.float16, 64, 16, 1, 2, 20, 4, 16, 1.5),
    (torch.float32, 128, 32, 8, 1, 33, 2, 32, 1.5),
]


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, group, kv_heads, window, splits, tile_n, softcap",
    [(*case, None) for case in DECODE_CASES] + SOFTCAP_DECODE_CASES,
)
def test_decode_matches_reference(
    dtype, head_dim, block_size, group, kv_heads, window, splits, tile_n, softcap
):
    num_heads = group * kv_heads
    batch = make_paged_batch(
        [n - 1 for n in DECODE_SEQ_LENS],
        [1] * len(DECODE_SEQ_LENS),
        num_heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=head_dim + block_size + group,
        device=DEVICE,
    )
    scale = head_dim**-0.5
    out = torch.empty_like(batch.query)
    partials = (
        KERNELS.split_kv.allocate_partials(len(DECODE_SEQ_LENS), num_heads, splits, head_dim, DEVICE)
        if splits > 1
        else None
    )
    KERNELS.decode.paged_decode(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        scale,
        window,
        splits,
        partials,
        KernelConfig(tile_n=tile_n, num_warps=4, num_stages=2),
        softcap,
    )
    expected = reference.reference_decode(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        scale,
        window,
        softcap,
    )
    assert_close(out, expected, dtype)
    if softcap is not None:  # the cap really changes this output: ignoring it would fail
        uncapped = reference.reference_paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
            window,
        )
        assert (out.float() - uncapped).abs().max() > 10 * TOLERANCE[dtype]


# (dtype, head_dim, block_size, query_group, num_kv_heads, sliding_window, block_m, tile_n)
PREFILL_CASES = [
    (torch.float32, 64, 16, 1, 2, None, 16, 16),
    (torch.float16, 64, 16, 3, 2, None, 64, 32),
    (torch.float16, 128, 32, 8, 1, None, 32, 64),
    (torch.bfloat16, 64, 64, 3, 1, None, 32, 32),
    (torch.float32, 256, 16, 1, 1, 9, 16, 16),
    (torch.float16, 64, 32, 8, 1, 17, 64, 16),
]
# (cached prefix, new tokens): fresh prompts (exact, partial, single token), prefix hits at and off
# block boundaries followed by extends, a one-token extend
PREFILL_SEQUENCES = [(0, 23), (16, 16), (37, 5), (3, 40), (0, 1), (64, 9), (20, 1)]


SOFTCAP_PREFILL_CASES = [
    (torch.float32, 64, 16, 3, 2, None, 32, 16, 1.5),
    (torch.float16, 64, 32, 8, 1, 17, 64, 16, 1.5),
]


@pytest.mark.parametrize(
    "dtype, head_dim, block_size, group, kv_heads, window, block_m, tile_n, softcap",
    [(*case, None) for case in PREFILL_CASES] + SOFTCAP_PREFILL_CASES,
)
def test_prefill_matches_reference(
    dtype, head_dim, block_size, group, kv_heads, window, block_m, tile_n, softcap
):
    contexts, new_tokens = zip(*PREFILL_SEQUENCES, strict=True)
    batch = make_paged_batch(
        list(contexts),
        list(new_tokens),
        group * kv_heads,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        seed=7 * head_dim + block_size,
        device=DEVICE,
    )
    scale = head_dim**-0.5
    out = torch.empty_like(batch.query)
    KERNELS.prefill.paged_prefill(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        max(new_tokens),
        scale,
        window,
        KernelConfig(tile_n=tile_n, num_warps=4, num_stages=2, block_m=block_m),
        softcap,
    )
    expected = reference.reference_prefill(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        window,
        softcap,
    )
    assert_close(out, expected, dtype)
    if softcap is not None:  # the cap really changes this output: ignoring it would fail
        uncapped = reference.reference_paged_attention(
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
            window,
        )
        assert (out.float() - uncapped).abs().max() > 10 * TOLERANCE[dtype]


def test_prefill_reads_only_its_slice_of_a_step():
    """Prefill sequences after two decodes: offsets into query/out come from query_start_loc."""
    batch = make_paged_batch(
        [5, 30, 0, 12], [1, 1, 19, 6], 4, 2, 64, 16, torch.float16, seed=3, device=DEVICE
    )
    out = torch.full_like(batch.query, 7.0)
    KERNELS.prefill.paged_prefill(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables[2:],
        batch.seq_lens[2:],
        batch.query_start_loc[2:],
        19,
        0.125,
    )
    expected = reference.reference_prefill(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        0.125,
    )
    assert torch.all(out[:2] == 7.0), "prefill wrote into the decode tokens' rows"
    assert_close(out[2:], expected[2:], torch.float16)


@pytest.mark.parametrize(
    "cache_dtype, head_dim, block_size, kv_heads",
    [
        (torch.float16, 64, 16, 2),
        (torch.bfloat16, 128, 32, 3),
        (torch.float32, 256, 64, 1),
    ],
)
def test_kv_write_matches_reference(cache_dtype, head_dim, block_size, kv_heads):
    generator = torch.Generator().manual_seed(head_dim)
    num_blocks = 4
    caches = [
        torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=generator).to(DEVICE, cache_dtype)
        for _ in range(2)
    ]
    expected_caches = [cache.clone() for cache in caches]
    # fp32 projections sliced out of a fused qkv tensor: non-contiguous, converted on write. Their values
    # are representable in the cache dtype because the interpreter truncates fp32 -> bf16 where GPUs
    # (and torch) round to nearest even; the test checks the scatter, not Triton's rounding.
    qkv = torch.randn(6, 3, kv_heads, head_dim, generator=generator).to(DEVICE, cache_dtype).float()
    key, value = qkv[:, 1], qkv[:, 2]
    # first and last slot of the cache, a block boundary, a padded (negative) slot
    slots = torch.tensor(
        [0, block_size - 1, block_size, -1, 2 * block_size + 3, num_blocks * block_size - 1], device=DEVICE
    )
    KERNELS.kv_write.write_kv(key, value, caches[0], caches[1], slots)
    reference.reference_write_kv(key, value, expected_caches[0], expected_caches[1], slots)
    assert torch.equal(caches[0], expected_caches[0])
    assert torch.equal(caches[1], expected_caches[1])
    # the written rows really changed (the reference is not a no-op on these inputs)
    assert torch.equal(caches[0][2, 3], key[4].to(cache_dtype))


def test_split_results_merge_to_the_unsplit_output():
    """Split-KV and one-split decode agree to rounding on a long context, including empty splits."""
    batch = make_paged_batch([150, 0, 40], [1, 1, 1], 8, 1, 64, 16, torch.float32, seed=11, device=DEVICE)
    outputs = []
    for splits in (1, 6):
        out = torch.empty_like(batch.query)
        partials = KERNELS.split_kv.allocate_partials(3, 8, splits, 64, DEVICE) if splits > 1 else None
        KERNELS.decode.paged_decode(
            out,
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            None,
            splits,
            partials,
        )
        outputs.append(out)
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "splits, min_split_tokens, used",
    [
        # 32-key tiles: 700 keys are 22 tiles, 300 are 10; >= 256 keys is >= 8 tiles a split
        (4, 256, [3, 1, 1, 2]),  # the long sequences take what they need, the short ones 1
        (16, 256, [3, 1, 1, 2]),  # one fixed plan for any batch (MAX_KV_SPLITS): the same splits
        (3, 1, [3, 2, 1, 3]),  # every sequence spread over all the splits (the per-batch rule)
        (2, 10_000, [1, 1, 1, 1]),  # a minimum above every context: one split each
    ],
)
def test_each_sequence_takes_only_the_splits_its_context_needs(splits, min_split_tokens, used):
    """A launch's split count is an upper bound; each sequence's splits hold >= min_split_tokens keys
    (the splits it leaves empty have log-sum-exp -inf). Whatever the plan, the output is the reference
    attention."""
    lens = [700, 40, 3, 300]
    batch = make_paged_batch(
        [n - 1 for n in lens], [1] * len(lens), 4, 2, 64, 16, torch.float32, seed=5, device=DEVICE
    )
    out = torch.empty_like(batch.query)
    KERNELS.decode.paged_decode(
        out,
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_tables,
        batch.seq_lens,
        0.125,
        None,
        splits,
        partials := KERNELS.split_kv.allocate_partials(len(lens), 4, splits, 64, DEVICE),
        min_split_tokens=min_split_tokens,
    )
    lse = partials[1]  # [seqs, heads, splits]
    assert (lse > float("-inf")).all(dim=1).sum(dim=1).tolist() == used
    expected = reference.reference_decode(
        batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens, 0.125, None
    )
    assert_close(out, expected, torch.float32)


def test_decode_refuses_splits_without_scratch():
    batch = make_paged_batch([20], [1], 2, 1, 64, 16, torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="allocate_partials"):
        KERNELS.decode.paged_decode(
            torch.empty_like(batch.query),
            batch.query,
            batch.key_cache,
            batch.value_cache,
            batch.block_tables,
            batch.seq_lens,
            0.125,
            None,
            2,
        )
