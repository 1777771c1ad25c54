"""The C kernels on fp8 and int8 KV caches (docs/architecture.md#kv-cache-dtype) against their PyTorch
references: the K/V write produces the reference's codes and scales bit for bit, and decode/prefill attention
over the codes equals attention over their dequantized values."""

from __future__ import annotations

import pytest
import torch
from kv_quant_caches import FORMATS, clone_quant, empty_quantized_caches, quantized_caches, spread_values

from kvpilot.engine.kv.kv_quant import KVQuant, fp8_e4m3_values
from kvpilot.engine.native import ops as native
from kvpilot.engine.native import reference


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return native.load_native_ops(tmp_path_factory.mktemp("native"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("kv_heads, head_dim, block_size", [(2, 16, 8), (3, 64, 16), (1, 128, 1)])
def test_write_kv_codes_equal_the_reference(kernels, kv_cache_dtype, kv_heads, head_dim, block_size):
    g = _gen(kv_heads * head_dim + block_size)
    shape = (8, kv_heads, block_size, head_dim)
    kc, vc, quant = empty_quantized_caches(shape, kv_cache_dtype)
    ekc, evc, equant = kc.clone(), vc.clone(), clone_quant(quant)
    tokens, width = 6, kv_heads * head_dim
    key = spread_values(tokens * width, g).view(tokens, width)
    value = torch.randn(tokens, width, generator=g) * 0.3
    # block starts and ends, mid-block, a padded (negative) slot; all distinct
    bs = block_size
    slots = torch.tensor([bs, 4 * bs - 1, -1, 5 * bs + bs // 2, 7 * bs, 2 * bs])
    kernels.write_kv(key, value, kc, vc, slots, quant)
    reference.reference_write_kv(key, value, ekc, evc, slots, equant)
    assert torch.equal(kc.view(torch.uint8), ekc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), evc.view(torch.uint8))
    if quant.key_scales is not None:
        assert torch.equal(quant.key_scales, equant.key_scales)
        assert torch.equal(quant.value_scales, equant.value_scales)
    written = int((kc.view(torch.uint8) != 0).any(-1).sum())
    assert 0 < written <= 5 * kv_heads  # only the five real tokens' rows


def test_fp8_codes_cover_every_finite_e4m3_value(kernels):
    """Every finite e4m3 value written through the C encoder comes back as itself (scale 1)."""
    values = fp8_e4m3_values()
    finite = values[torch.isfinite(values)]
    rows = -(-finite.numel() // 16)
    padded = torch.zeros(rows * 16)
    padded[: finite.numel()] = finite
    kc, vc, _ = empty_quantized_caches((rows, 1, 1, 16), "fp8-tensor")
    quant = KVQuant("fp8", 1.0, 1.0)
    x = padded.view(rows, 16)
    kernels.write_kv(x, x, kc, vc, torch.arange(rows), quant)
    assert torch.equal(kc.float().reshape(-1), padded)


def _tables(lengths, block_size, g, extra=0):
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(blocks_per_seq) + extra
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lengths), max(blocks_per_seq) + 1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    return num_blocks, tables


# (lengths, Hq, Hkv, D, block_size, window): GQA 1-8, blocks of 1-128 (more than the 64-row chunk)
DECODE_CASES = [
    ([1, 16, 17, 40, 163], 9, 3, 64, 16, None),
    ([129, 33], 4, 2, 32, 4, 50),
    ([130, 3], 8, 1, 128, 128, None),
    ([7, 12], 2, 2, 16, 1, None),
]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("lengths, num_heads, kv_heads, head_dim, block_size, window", DECODE_CASES)
def test_paged_decode_over_codes_matches_reference(
    kernels, kv_cache_dtype, lengths, num_heads, kv_heads, head_dim, block_size, window
):
    g = _gen(sum(lengths) + len(kv_cache_dtype))
    num_blocks, tables = _tables(lengths, block_size, g, extra=2)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    kc, vc, quant = quantized_caches(
        torch.randn(shape, generator=g), torch.randn(shape, generator=g), kv_cache_dtype
    )
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    query = torch.randn(len(lengths), num_heads * head_dim, generator=g)
    scale = head_dim**-0.5
    out = kernels.attention.paged_decode(query, kc, vc, tables, seq_lens, scale, window, None, quant)
    expected = reference.reference_paged_decode(query, kc, vc, tables, seq_lens, scale, window, None, quant)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)
    # negative control: the codes read as if their scale were 1 give another answer
    if kv_cache_dtype == "fp8-tensor":
        wrong = reference.reference_paged_decode(
            query, kc, vc, tables, seq_lens, scale, window, None, KVQuant("fp8", 1.0, 1.0)
        )
        assert (wrong - out).abs().max() > 1e-2


# (new tokens, cached tokens, Hq, Hkv, D, block_size, window): a first chunk, extends after a cached
# prefix (chunked prefill), GQA 1-64, windows
PREFILL_CASES = [
    ([37, 1, 16], [0, 5, 100], 9, 3, 64, 16, None),
    ([40, 23], [0, 70], 9, 3, 64, 16, 20),
    ([30], [0], 64, 1, 64, 16, 7),
    ([20, 3], [0, 9], 6, 2, 16, 8, None),
]


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("new, cached, num_heads, kv_heads, head_dim, block_size, window", PREFILL_CASES)
def test_paged_prefill_over_codes_matches_reference(
    kernels, kv_cache_dtype, new, cached, num_heads, kv_heads, head_dim, block_size, window
):
    if not kernels.attention.has_prefill:
        pytest.skip("paged_prefill needs AVX2")
    g = _gen(sum(new) + sum(cached))
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    num_blocks, tables = _tables(lengths, block_size, g)
    shape = (num_blocks, kv_heads, block_size, head_dim)
    kc, vc, quant = quantized_caches(
        torch.randn(shape, generator=g), torch.randn(shape, generator=g), kv_cache_dtype
    )
    offsets = [0]
    for n in new:
        offsets.append(offsets[-1] + n)
    starts = torch.tensor(offsets, dtype=torch.int32)
    query = torch.randn(offsets[-1], num_heads * head_dim, generator=g)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    out = kernels.attention.paged_prefill(query, kc, vc, tables, starts, seq_lens, scale, window, None, quant)
    expected = reference.reference_paged_prefill(
        query, kc, vc, tables, starts, seq_lens, scale, window, None, quant
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_wrappers_refuse_codes_without_their_scales(kernels):
    codes = torch.zeros(3, 1, 4, 16, dtype=torch.int8)
    table = torch.ones(1, 2, dtype=torch.int32)
    lens = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(ValueError, match="per-row key_scales"):
        kernels.attention.paged_decode(
            torch.zeros(1, 16), codes, codes, table, lens, 1.0, None, None, KVQuant("int8")
        )
    with pytest.raises(ValueError, match=r"key_cache must be a contiguous torch\.float32"):
        kernels.attention.paged_decode(torch.zeros(1, 16), codes, codes, table, lens, 1.0, None)
    bad = KVQuant("int8", key_scales=torch.zeros(3, 1, 5), value_scales=torch.zeros(3, 1, 4))
    with pytest.raises(ValueError, match=r"key_scales must be .* \[3, 1, 4\]"):
        kernels.write_kv(torch.zeros(1, 16), torch.zeros(1, 16), codes, codes, torch.tensor([1]), bad)
    fp8 = codes.view(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale must be a positive"):
        kernels.write_kv(
            torch.zeros(1, 16), torch.zeros(1, 16), fp8, fp8, torch.tensor([1]), KVQuant("fp8", 0.0, 1.0)
        )


@pytest.mark.parametrize("kv_cache_dtype", FORMATS)
@pytest.mark.parametrize("with_c_kernels", [True, False], ids=["c-kernels", "pytorch-ops"])
def test_torch_backend_forward_writes_codes_then_attends_them(kernels, kv_cache_dtype, with_c_kernels):
    """One mixed step (two decodes, a fresh prompt, an extend) through the CPU backend, on its HND cache:
    the new tokens' codes equal the reference's and every query attends the dequantized cache."""
    from kvpilot.engine.attention.kernels.reference import reference_paged_attention
    from kvpilot.engine.attention.kernels.synthetic import make_paged_batch
    from kvpilot.engine.attention.torch_backend import TorchAttentionBackend
    from kvpilot.engine.kv.kv_quant import dequantize_caches

    batch = make_paged_batch([9, 30, 0, 17], [1, 1, 12, 5], 6, 2, 32, 16, torch.float32, seed=3)
    hnd = [c.nan_to_num(0.0).transpose(1, 2).contiguous() for c in (batch.key_cache, batch.value_cache)]
    kc, vc, quant = quantized_caches(hnd[0], hnd[1], kv_cache_dtype)
    g = _gen(4)
    key, value = (
        torch.randn(batch.query.shape[0], 2, 32, generator=g),
        torch.randn(batch.query.shape[0], 2, 32, generator=g),
    )
    ekc, evc, equant = kc.clone(), vc.clone(), clone_quant(quant)
    reference.reference_write_kv(key.flatten(1), value.flatten(1), ekc, evc, batch.slot_mapping, equant)
    backend = TorchAttentionBackend(6, 2, 32, 32**-0.5)
    backend.native = kernels if with_c_kernels else None
    meta = batch.metadata(2)
    backend.prepare(meta)
    out = backend.forward(batch.query, key, value, kc, vc, meta, None, quant)
    assert torch.equal(kc.view(torch.uint8), ekc.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), evc.view(torch.uint8))
    k_values, v_values = (c.transpose(1, 2) for c in dequantize_caches(ekc, evc, equant))  # back to NHD
    expected = reference_paged_attention(
        batch.query, k_values, v_values, batch.block_tables, batch.seq_lens, batch.query_start_loc, 32**-0.5
    )
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=0)


@pytest.mark.parametrize("per_row", [False, True], ids=["tensor-scale", "row-scales"])
def test_c_kernels_read_every_e4m3_code_as_torch_does(kernels, per_row):
    """Sequence b's one key and value hold codes 16b .. 16b + 15: attention over a single key returns its
    value row exactly, so the decode output is the kernels' reading of every bit pattern (vector and
    scalar paths); NaN's two patterns are never written and read as 0 here."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    cache = codes.view(16, 1, 1, 16).view(torch.float8_e4m3fn)  # 16 blocks of one slot, one head, D = 16
    scales = torch.full((16, 1, 1), 0.5)
    quant = KVQuant("fp8", key_scales=scales, value_scales=scales) if per_row else KVQuant("fp8", 1.0, 0.5)
    tables = torch.arange(16, dtype=torch.int32).view(16, 1)
    out = kernels.attention.paged_decode(
        torch.zeros(16, 16), cache, cache, tables, torch.ones(16, dtype=torch.int32), 1.0, None, None, quant
    )
    expected = codes.view(torch.float8_e4m3fn).float().view(16, 1, 16) * 0.5
    assert torch.equal(out, expected)
