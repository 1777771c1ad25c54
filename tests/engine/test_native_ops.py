"""The C kernels of kvpilot.engine.native against their PyTorch references, and the build's contract."""

from __future__ import annotations

import pytest
import torch

from kvpilot.engine.native import ops as native
from kvpilot.engine.native import reference
from kvpilot.engine.native.build import NativeBuildError, build_library


@pytest.fixture(scope="module")
def kernels(tmp_path_factory):
    return native.load_native_ops(tmp_path_factory.mktemp("native"))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize(
    "tokens, hidden, with_delta", [(1, 64, True), (7, 576, True), (33, 576, False), (3, 5, True)]
)
def test_add_rms_norm(kernels, tokens, hidden, with_delta):
    g = _gen(tokens + hidden)
    base = torch.randn(tokens, hidden + 3, generator=g)  # strided rows
    residual = base[:, :hidden]
    delta = torch.randn(tokens, hidden, generator=g) if with_delta else None
    weight = torch.rand(hidden, generator=g) + 0.5
    expected_residual = residual.clone()
    expected = reference.reference_add_rms_norm(expected_residual, delta, weight, 1e-5)
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(residual, expected_residual, atol=0, rtol=0)
    assert torch.equal(base[:, hidden:], base[:, hidden:].clone())


# (heads, head_dim, rotated dims per head): whole heads, and partial rotary (Phi-4-mini: 3/4 of a head)
@pytest.mark.parametrize("heads, head_dim, rotary", [(9, 64, 64), (4, 16, 16), (2, 128, 128), (5, 32, 24)])
def test_rope_rotates_only_the_given_heads(kernels, heads, head_dim, rotary):
    g = _gen(heads * head_dim)
    tokens, extra = 6, 2 * head_dim  # the row also holds two heads that must stay untouched
    x = torch.randn(tokens, heads * head_dim + extra, generator=g)
    positions = torch.tensor([0, 5, 1, 99, 3, 3])
    angles = torch.randn(100, rotary // 2, generator=g)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    expected = x.clone()
    reference.reference_rope_(expected, heads, head_dim, positions, cos, sin)
    kernels.rope_(x, heads, head_dim, positions, cos, sin)
    torch.testing.assert_close(x, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(x[:, heads * head_dim :], expected[:, heads * head_dim :])
    if rotary < head_dim:  # each head's unrotated tail is left as it was
        tails = x[:, : heads * head_dim].view(tokens, heads, head_dim)[..., rotary:]
        before = expected[:, : heads * head_dim].view(tokens, heads, head_dim)[..., rotary:]
        assert torch.equal(tails, before)


def test_write_kv_scatters_into_hnd_blocks_and_skips_padding(kernels):
    g = _gen(1)
    caches = [torch.zeros(4, 2, 8, 16) for _ in range(2)]
    expected = [c.clone() for c in caches]
    qkv = torch.randn(5, 3 * 32, generator=g)
    key, value = qkv[:, 32:64], qkv[:, 64:]
    slots = torch.tensor([0, 7, 8, -1, 31])
    kernels.write_kv(key, value, caches[0], caches[1], slots)
    reference.reference_write_kv(key, value, expected[0], expected[1], slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    # slot 8 = block 1, offset 0; head 1 holds columns 16..31 of the token's key row
    assert torch.equal(caches[0][1, 1, 0], key[2, 16:])
    assert int((caches[0] != 0).any(-1).sum()) == 4 * 2  # four tokens x two heads written


def test_silu_mul(kernels):
    gate_up = torch.randn(9, 2 * 1536, generator=_gen(2)) * 4
    torch.testing.assert_close(
        kernels.silu_mul(gate_up), reference.reference_silu_mul(gate_up), atol=1e-5, rtol=1e-5
    )


@pytest.mark.parametrize("tokens, inter", [(9, 1536), (1, 7), (40, 64)])
def test_gelu_tanh_mul(kernels, tokens, inter):
    gate_up = torch.randn(tokens, 2 * inter, generator=_gen(tokens)) * 4
    out = kernels.gelu_tanh_mul(gate_up)
    torch.testing.assert_close(out, reference.reference_gelu_tanh_mul(gate_up), atol=1e-5, rtol=1e-5)
    # the tanh approximation, not the exact (erf) GELU: they differ by more than the tolerance
    gate, up = gate_up.chunk(2, dim=-1)
    assert (out - torch.nn.functional.gelu(gate) * up).abs().max() > 1e-4


# (lengths, Hq, Hkv, D, block_size, window): GQA groups 1-8, blocks of 4/16/32 and 128 (more than the
# kernel's 64-key score buffer), windows that start mid-block
DECODE_CASES = [
    ([1, 16, 17, 40, 163], 9, 3, 64, 16, None),
    ([200, 77, 64], 9, 3, 64, 16, 45),
    ([129, 33], 4, 2, 32, 4, None),
    ([97, 300], 8, 4, 64, 32, 101),
    ([5, 64, 70], 4, 4, 32, 16, None),
    ([130, 3], 8, 1, 128, 128, None),
    ([50, 20, 1], 6, 2, 64, 16, 17),
]


@pytest.mark.parametrize("softcap", [None, 1.5], ids=["no-softcap", "softcap"])
@pytest.mark.parametrize("lengths, num_heads, kv_heads, head_dim, block_size, window", DECODE_CASES)
def test_paged_decode_matches_reference(
    kernels, lengths, num_heads, kv_heads, head_dim, block_size, window, softcap
):
    g = _gen(sum(lengths))
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(blocks_per_seq) + 2
    key_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(blocks_per_seq) + 1
    tables = torch.zeros(len(lengths), width, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    qkv = torch.randn(len(lengths), (num_heads + 2 * kv_heads) * head_dim, generator=g)
    query = qkv[:, : num_heads * head_dim]
    scale = head_dim**-0.5
    out = kernels.attention.paged_decode(
        query, key_cache, value_cache, tables, seq_lens, scale, window, softcap
    )
    expected = reference.reference_paged_decode(
        query, key_cache, value_cache, tables, seq_lens, scale, window, softcap
    )
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_wrappers_refuse_layouts_the_kernels_would_misread(kernels):
    with pytest.raises(ValueError, match="float32"):
        kernels.silu_mul(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="contiguous rows"):
        kernels.add_rms_norm(torch.zeros(8, 4).t(), None, torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="positions must lie"):
        kernels.rope_(torch.zeros(1, 16), 1, 16, torch.tensor([4]), torch.zeros(4, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="outside the cache"):
        kernels.write_kv(
            torch.zeros(1, 16),
            torch.zeros(1, 16),
            torch.zeros(2, 1, 4, 16),
            torch.zeros(2, 1, 4, 16),
            torch.tensor([8]),
        )
    with pytest.raises(ValueError, match="longer than its block table"):
        kernels.attention.paged_decode(
            torch.zeros(1, 16),
            torch.zeros(3, 1, 4, 16),
            torch.zeros(3, 1, 4, 16),
            torch.ones(1, 1, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            0.25,
            None,
        )
    with pytest.raises(ValueError, match="block ids"):
        kernels.attention.paged_decode(
            torch.zeros(1, 16),
            torch.zeros(3, 1, 4, 16),
            torch.zeros(3, 1, 4, 16),
            torch.full((1, 2), 3, dtype=torch.int32),
            torch.tensor([5], dtype=torch.int32),
            0.25,
            None,
        )


def test_build_is_cached_and_reports_a_missing_compiler(tmp_path, monkeypatch):
    first = build_library(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert build_library(tmp_path) == first and first.stat().st_mtime_ns == mtime
    monkeypatch.setenv("CC", "no-such-compiler-kvpilot")
    with pytest.raises(NativeBuildError, match="no C compiler"):
        build_library(tmp_path / "other")


@pytest.mark.parametrize(
    "rows, out_features, in_features, with_bias",
    [
        (1, 960, 576, False),
        (2, 12, 64, True),
        (5, 7, 13, True),
        (6, 16, 16, False),
        (7, 33, 40, True),
        (13, 49, 1536, False),
        (24, 96, 576, True),
        (96, 20, 24, False),
    ],
)
def test_linear_matches_f_linear(kernels, rows, out_features, in_features, with_bias):
    """Every row remainder of the 6-row tile (1–5, and whole tiles), outputs that are not a multiple of
    the 16-column panel, any K, strided input rows."""
    g = _gen(rows * out_features)
    x = torch.randn(rows, in_features + 8, generator=g)[:, :in_features]
    weight = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    bias = torch.randn(out_features, generator=g) if with_bias else None
    expected = torch.nn.functional.linear(x, weight, bias)
    got = kernels.linear(x, kernels.pack_linear_weight(weight), bias, out_features)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_pack_linear_weight_layout(kernels):
    weight = torch.arange(18 * 3, dtype=torch.float32).view(18, 3)
    packed = kernels.pack_linear_weight(weight)
    assert packed.shape == (2, 3, 16)
    assert packed[0, 2, 5].item() == weight[5, 2].item() == 17.0
    assert packed[1, 1, 1].item() == weight[17, 1].item() == 52.0
    assert packed[1, :, 2:].abs().sum().item() == 0.0  # rows past N are zero


def test_linear_refuses_a_weight_packed_for_other_shapes(kernels):
    packed = kernels.pack_linear_weight(torch.zeros(20, 12))
    with pytest.raises(ValueError, match=r"packed_weight must be \[2, 16, 16\]"):
        kernels.linear(torch.zeros(1, 16), packed, None, 20)
    with pytest.raises(ValueError, match=r"packed_weight must be \[3, 12, 16\]"):
        kernels.linear(torch.zeros(1, 12), packed, None, 40)
    with pytest.raises(ValueError, match=r"bias must be \[20\]"):
        kernels.linear(torch.zeros(1, 12), packed, torch.zeros(16), 20)
    with pytest.raises(ValueError, match="2-D"):
        kernels.pack_linear_weight(torch.zeros(4))


# (new tokens per sequence, cached tokens before them, Hq, Hkv, D, block_size, window): GQA groups 1-64 (a
# group larger than the 24-row tile), chunks that end mid-block, extends after a cached prefix, windows
# that start mid-block and cut into a chunk, blocks of 8-64
PREFILL_CASES = [
    ([5], [0], 9, 3, 64, 16, None),
    ([37, 1, 16, 17], [0, 5, 32, 100], 9, 3, 64, 16, None),
    ([40, 23], [0, 70], 9, 3, 64, 16, 20),
    ([33], [10], 8, 8, 64, 16, None),
    ([50, 9], [3, 0], 4, 1, 128, 32, None),
    ([30], [0], 64, 1, 64, 16, 7),
    ([146, 61], [0, 200], 9, 3, 64, 64, 100),
    ([20, 3], [0, 9], 6, 2, 16, 8, None),
]


@pytest.mark.parametrize("new, cached, num_heads, kv_heads, head_dim, block_size, window", PREFILL_CASES)
@pytest.mark.parametrize("decodes_first", [0, 3])
@pytest.mark.parametrize("softcap", [None, 1.5], ids=["no-softcap", "softcap"])
def test_paged_prefill_matches_reference(
    kernels, new, cached, num_heads, kv_heads, head_dim, block_size, window, decodes_first, softcap
):
    g = _gen(sum(new) + sum(cached) + decodes_first)
    lengths = [c + n for c, n in zip(cached, new, strict=True)]
    blocks_per_seq = [-(-n // block_size) for n in lengths]
    num_blocks = 1 + sum(blocks_per_seq)
    key_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    value_cache = torch.randn(num_blocks, kv_heads, block_size, head_dim, generator=g)
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(len(lengths), max(blocks_per_seq) + 1, dtype=torch.int32)
    for b, n in enumerate(blocks_per_seq):
        tables[b, :n] = torch.tensor([ids.pop() for _ in range(n)], dtype=torch.int32)
    # the flat batch's rows: decode rows first (not this kernel's), then each sequence's new tokens
    offsets = [decodes_first]
    for n in new:
        offsets.append(offsets[-1] + n)
    starts = torch.tensor(offsets, dtype=torch.int32)
    qkv = torch.randn(offsets[-1], (num_heads + 2 * kv_heads) * head_dim, generator=g)
    query = qkv[:, : num_heads * head_dim]
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    scale = head_dim**-0.5
    out = kernels.attention.paged_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, scale, window, softcap
    )
    expected = reference.reference_paged_prefill(
        query, key_cache, value_cache, tables, starts, seq_lens, scale, window, softcap
    )
    assert out.shape == (sum(new), num_heads, head_dim)
    torch.testing.assert_close(out, expected, atol=2e-6, rtol=1e-5)


def test_paged_prefill_refuses_what_it_would_misread(kernels):
    cache = torch.zeros(3, 1, 4, 16)
    table = torch.ones(1, 2, dtype=torch.int32)
    one = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="more new tokens than its length"):
        kernels.attention.paged_prefill(
            torch.zeros(2, 16), cache, cache, table, one, torch.tensor([1], dtype=torch.int32), 0.25, None
        )
    with pytest.raises(ValueError, match="query offsets"):
        kernels.attention.paged_prefill(
            torch.zeros(1, 16), cache, cache, table, one, torch.tensor([2], dtype=torch.int32), 0.25, None
        )
    with pytest.raises(ValueError, match="longer than its block table"):
        kernels.attention.paged_prefill(
            torch.zeros(2, 16), cache, cache, table, one, torch.tensor([9], dtype=torch.int32), 0.25, None
        )
    with pytest.raises(ValueError, match="multiple of 16"):
        kernels.attention.paged_prefill(
            torch.zeros(2, 8),
            torch.zeros(3, 1, 4, 8),
            torch.zeros(3, 1, 4, 8),
            table,
            one,
            torch.tensor([2], dtype=torch.int32),
            0.25,
            None,
        )
