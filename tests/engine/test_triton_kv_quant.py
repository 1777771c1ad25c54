"""The Triton kernels on fp8 and int8 KV caches (docs/architecture.md#kv-cache-dtype), in the interpreter:
the K/V write produces the PyTorch reference's codes and scales bit for bit, and decode (split or not) and
prefill over the codes equal the reference attention over their dequantized values, with fp32 and fp16
queries, GQA groups 1-8, blocks of 1-32 and prefix + extend (chunked prefill) sequences."""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch
from kv_quant_caches import (
    FORMATS,
    clone_quant,
    empty_quantized_caches,
    quant_on,
    quantized_caches,
    spread_values,
)

from kvpilot.engine.attention.kernels import reference
from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
from kvpilot.engine.attention.kernels.tuning import KernelConfig
from kvpilot.engine.attention.triton_loader import load_kernels
from kvpilot.engine.kv.kv_quant import dequantize_caches

pytestmark = pytest.mark.triton

KERNELS = load_kernels(DEVICE)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3}


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("head_dim, block_size, kv_heads", [(64, 16, 2), (16, 1, 3), (128, 32, 1)])
def test_kv_write_codes_equal_the_reference(kv_cache_dtype, head_dim, block_size, kv_heads):
    g = torch.Generator().manual_seed(head_dim + block_size)
    num_blocks = 4
    kc, vc, quant = empty_quantized_caches((num_blocks, block_size, kv_heads, head_dim), kv_cache_dtype)
    ekc, evc, equant = kc.clone(), vc.clone(), clone_quant(quant)
    # non-contiguous rows sliced out of a fused projection, K spanning e4m3's range
    qkv = torch.randn(6, 3, kv_heads, head_dim, generator=g)
    qkv[:, 1] = spread_values(6 * kv_heads * head_dim, g).view(6, kv_heads, head_dim)
    key, value = qkv[:, 1], qkv[:, 2]
    slots = torch.tensor([0, block_size - 1, block_size, -1, 2 * block_size, num_blocks * block_size - 1])
    dquant = quant_on(quant, DEVICE)
    dk, dv = kc.to(DEVICE), vc.to(DEVICE)
    KERNELS.kv_write.write_kv(key.to(DEVICE), value.to(DEVICE), dk, dv, slots.to(DEVICE), dquant)
    reference.reference_write_kv(key, value, ekc, evc, slots, equant)
    assert torch.equal(dk.cpu().view(torch.uint8), ekc.view(torch.uint8))
    assert torch.equal(dv.cpu().view(torch.uint8), evc.view(torch.uint8))
    if quant.key_scales is not None:
        assert torch.equal(dquant.key_scales.cpu(), equant.key_scales)
        assert torch.equal(dquant.value_scales.cpu(), equant.value_scales)
    assert (ekc.view(torch.uint8) != 0).any()  # the reference wrote something


def _quantized_batch(contexts, new, group, kv_heads, head_dim, block_size, dtype, kv_cache_dtype, seed):
    batch = make_paged_batch(
        contexts, new, group * kv_heads, kv_heads, head_dim, block_size, torch.float32, seed=seed
    )
    kc, vc, quant = quantized_caches(batch.key_cache, batch.value_cache, kv_cache_dtype)
    values = dequantize_caches(kc, vc, quant)
    return batch, batch.query.to(dtype), kc, vc, quant, values


# (query dtype, cache dtype, head_dim, block_size, group, kv_heads, window, splits)
DECODE_CASES = [
    (torch.float32, "fp8-tensor", 64, 16, 1, 2, None, 1),
    (torch.float16, "fp8", 64, 32, 3, 2, None, 3),
    (torch.float32, "fp8", 64, 16, 3, 2, 20, 1),
    (torch.float32, "int8", 64, 16, 8, 1, 20, 2),
    (torch.float16, "int8", 32, 1, 3, 2, None, 1),
]


@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, head_dim, block_size, group, kv_heads, window, splits", DECODE_CASES
)
def test_decode_over_codes_matches_reference(
    dtype, kv_cache_dtype, head_dim, block_size, group, kv_heads, window, splits
):
    lens = [1, 16, 17, 40]
    batch, query, kc, vc, quant, (k_values, v_values) = _quantized_batch(
        [n - 1 for n in lens],
        [1] * len(lens),
        group,
        kv_heads,
        head_dim,
        block_size,
        dtype,
        kv_cache_dtype,
        head_dim + group,
    )
    scale = head_dim**-0.5
    out = torch.empty_like(query, device=DEVICE)
    partials = (
        KERNELS.split_kv.allocate_partials(len(lens), group * kv_heads, splits, head_dim, DEVICE)
        if splits > 1
        else None
    )
    KERNELS.decode.paged_decode(
        out,
        query.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        batch.block_tables.to(DEVICE),
        batch.seq_lens.to(DEVICE),
        scale,
        window,
        splits,
        partials,
        KernelConfig(tile_n=16, num_warps=4, num_stages=2),
        None,
        quant_on(quant, DEVICE),
    )
    expected = reference.reference_decode(
        query.float(), k_values, v_values, batch.block_tables, batch.seq_lens, scale, window
    )
    torch.testing.assert_close(out.cpu().float(), expected, atol=TOLERANCE[dtype], rtol=0)


# (query dtype, cache dtype, head_dim, block_size, group, kv_heads, window)
PREFILL_CASES = [
    (torch.float32, "fp8-tensor", 64, 16, 3, 2, None),
    (torch.float16, "fp8", 64, 16, 3, 2, 9),
    (torch.float16, "int8", 64, 16, 1, 2, None),
    (torch.float32, "int8", 32, 8, 8, 1, 9),
]


@pytest.mark.parametrize(
    "dtype, kv_cache_dtype, head_dim, block_size, group, kv_heads, window", PREFILL_CASES
)
def test_prefill_over_codes_matches_reference(
    dtype, kv_cache_dtype, head_dim, block_size, group, kv_heads, window
):
    # fresh prompts, and extends after a cached prefix at and off block boundaries (chunked prefill)
    contexts, new = [0, 16, 37, 0], [23, 16, 5, 1]
    batch, query, kc, vc, quant, (k_values, v_values) = _quantized_batch(
        contexts, new, group, kv_heads, head_dim, block_size, dtype, kv_cache_dtype, 7 * head_dim
    )
    scale = head_dim**-0.5
    out = torch.empty_like(query, device=DEVICE)
    KERNELS.prefill.paged_prefill(
        out,
        query.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        batch.block_tables.to(DEVICE),
        batch.seq_lens.to(DEVICE),
        batch.query_start_loc.to(DEVICE),
        max(new),
        scale,
        window,
        KernelConfig(tile_n=16, num_warps=4, num_stages=2, block_m=32),
        None,
        quant_on(quant, DEVICE),
    )
    expected = reference.reference_prefill(
        query.float(),
        k_values,
        v_values,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        scale,
        window,
    )
    torch.testing.assert_close(out.cpu().float(), expected, atol=TOLERANCE[dtype], rtol=0)
    # negative control: the codes read as plain numbers (no scales) give another answer
    if kv_cache_dtype == "int8":
        raw = reference.reference_prefill(
            query.float(),
            kc.float(),
            vc.float(),
            batch.block_tables,
            batch.seq_lens,
            batch.query_start_loc,
            scale,
            window,
        )
        assert (raw - out.cpu().float()).abs().max() > 0.1


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
def test_backend_forward_writes_codes_then_attends_them(kv_cache_dtype):
    """One mixed step (two decodes, a fresh prompt, an extend) through the backend: the new tokens' codes
    land in their slots and every query attends the dequantized cache, its own step's keys included."""
    from kvpilot.engine.attention.triton_backend import TritonAttentionBackend

    batch = make_paged_batch([9, 30, 0, 17], [1, 1, 12, 5], 6, 2, 32, 16, torch.float32, seed=11)
    kc, vc, quant = quantized_caches(
        batch.key_cache.nan_to_num(0.0), batch.value_cache.nan_to_num(0.0), kv_cache_dtype
    )
    g = torch.Generator().manual_seed(1)
    key = torch.randn(batch.query.shape[0], 2, 32, generator=g)
    value = torch.randn(batch.query.shape[0], 2, 32, generator=g)
    ekc, evc, equant = kc.clone(), vc.clone(), clone_quant(quant)
    reference.reference_write_kv(key, value, ekc, evc, batch.slot_mapping, equant)
    backend = TritonAttentionBackend(6, 2, 32, 32**-0.5)
    out = backend.forward(batch.query, key, value, kc, vc, batch.metadata(2), None, quant)
    assert torch.equal(kc.view(torch.uint8), ekc.view(torch.uint8))
    k_values, v_values = dequantize_caches(ekc, evc, equant)
    expected = reference.reference_paged_attention(
        batch.query, k_values, v_values, batch.block_tables, batch.seq_lens, batch.query_start_loc, 32**-0.5
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="cannot be read with kv quantization None"):
        backend.attend(batch.query, key, value, kc, vc, batch.metadata(2))
    with pytest.raises(ValueError, match="cannot be read with kv quantization"):
        backend.attend(
            batch.query, key, value, batch.key_cache, batch.value_cache, batch.metadata(2), None, quant
        )
