"""The quantized GEMM (``quant_gemm.c``) against its PyTorch reference, and the reference against
dequantize-then-matmul with gguf's own (llama.cpp-faithful) dequantizer.

Every format (GGUF Q4_0 / Q4_1 / Q8_0 blocks made by gguf's quantizer, Q4_K / Q6_K super-blocks made by
tests/support/k_quants.py, kvpilot's int8 rows), both
schedules of the kernel (1-4 rows: dot products; more: dequantized slabs, K split in 512-input slices),
outputs that are not a multiple of its 12-row slab or 3-row tile, int8 rows whose length is not a multiple
of 32, strided input rows, with and without bias; each on this host's build (AVX-512 where it has it), an
AVX2-only build and the portable (scalar) build.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from gguf_files import K_QUANTIZERS

from kvpilot.engine.model.quant_formats import (
    QuantWeight,
    concat_rows,
    dequantize,
    dequantize_k,
    quantize_int8,
    unpack_blocks,
)
from kvpilot.engine.native import ops as native
from kvpilot.engine.native.quant_ops import FORMATS
from kvpilot.engine.native.reference import reference_quant_linear

GGUF_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
#: the builds tested: this host's (-march=native: AVX-512 where it has it), AVX2 without AVX-512, scalar
BUILDS = {"native": (), "avx2": ("-mno-avx512f",), "portable": ("-mno-avx2", "-mno-fma", "-mno-f16c")}


@pytest.fixture(scope="module", params=list(BUILDS))
def kernels(request, tmp_path_factory):
    ops = native.load_native_ops(tmp_path_factory.mktemp("native"), BUILDS[request.param])
    if request.param != "portable" and not ops.quant.vectorized:
        pytest.skip("this CPU or compiler has no AVX2/FMA")
    assert ops.quant.vectorized == (request.param != "portable")
    return ops.quant


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_weight(fmt: str, out_features: int, in_features: int, seed: int) -> tuple[QuantWeight, torch.Tensor]:
    """A quantized random weight (one all-zero row, so a zero block scale is covered) and its source."""
    w = torch.randn(out_features, in_features, generator=_gen(seed)) / in_features**0.5
    w[min(1, out_features - 1)] = 0.0
    if fmt == "int8":
        return quantize_int8(w), w
    if fmt in K_QUANTIZERS:
        return QuantWeight(FORMATS[fmt], torch.from_numpy(K_QUANTIZERS[fmt](w.numpy())), None, in_features), w
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(blocks), None, in_features), w


# (rows, out_features, in_features): 1-4 rows take the dot-product schedule, 5+ the slab one (3-row
# tiles and their remainders); 544 and 1536 inputs cross its 512-input slices; outputs that end mid-slab
# (12 rows) and mid-tile (3 rows)
SHAPES = [(1, 576, 576), (2, 33, 64), (3, 7, 96), (4, 17, 32), (5, 16, 256), (6, 50, 288), (7, 26, 544)]
SHAPES += [(13, 40, 576), (64, 96, 1536)]
INT8_SHAPES = [(1, 9, 13), (3, 5, 45), (7, 20, 300), (12, 33, 65), (5, 14, 600)]  # int8 rows of any length


def _cases():
    for fmt in (*GGUF_FORMATS, "int8"):
        for i, shape in enumerate(SHAPES + (INT8_SHAPES if fmt == "int8" else [])):
            yield pytest.param(fmt, *shape, i % 2 == 0, id=f"{fmt}-{'x'.join(map(str, shape))}")


@pytest.mark.parametrize("fmt, rows, out_features, in_features, with_bias", list(_cases()))
def test_kernel_matches_reference(kernels, fmt, rows, out_features, in_features, with_bias):
    weight, _ = make_weight(fmt, out_features, in_features, seed=rows * out_features + in_features)
    g = _gen(rows)
    x = torch.randn(rows, in_features + 5, generator=g)[:, :in_features]  # strided rows
    bias = torch.randn(out_features, generator=g) if with_bias else None
    expected = reference_quant_linear(x, weight, bias)
    got = kernels.linear(x, weight.data, weight.scales, fmt, bias)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt", (*GGUF_FORMATS, "int8"))
@pytest.mark.parametrize("rows, out_features, in_features", [(1, 40, 96), (9, 64, 576)])
def test_reference_is_dequantize_then_matmul(fmt, rows, out_features, in_features):
    """The block-by-block reference equals x @ W^T with W dequantized independently: by gguf (llama.cpp's
    formulas, numpy) for the GGUF formats, by q * scale for int8; in float64 both sides."""
    weight, _ = make_weight(fmt, out_features, in_features, seed=in_features)
    if fmt == "int8":
        dense = weight.data.view(torch.int8).double() * weight.scales.double()[:, None]
    else:
        dense = torch.from_numpy(gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[fmt])).double()
    x = torch.randn(rows, in_features, generator=_gen(7))
    expected = (x.double() @ dense.T).float()
    torch.testing.assert_close(reference_quant_linear(x, weight, None), expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("fmt", (*GGUF_FORMATS, "int8"))
def test_dequantize_kernel_matches_pytorch(kernels, fmt):
    """The C dequantization (what large batches multiply with a float32 GEMM): the same values, up to one
    rounding (Q4_1's d * q + m is one fused multiply-add in C)."""
    in_features = 100 if fmt == "int8" else 96
    weight, _ = make_weight(fmt, 13, in_features, seed=11)
    out = torch.full((13, in_features), float("nan"))
    assert kernels.dequantize(weight.data, weight.scales, fmt, in_features, out) is out
    torch.testing.assert_close(out, dequantize(weight), atol=1e-7, rtol=1e-6)
    with pytest.raises(ValueError, match="out must be a contiguous float32"):
        kernels.dequantize(weight.data, weight.scales, fmt, in_features, torch.empty(13, in_features + 1))


@pytest.mark.parametrize("fmt", GGUF_FORMATS)
def test_dequantize_equals_gguf_bit_for_bit(fmt):
    weight, _ = make_weight(fmt, 24, 128, seed=3)
    expected = gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[fmt])
    assert np.array_equal(dequantize(weight).numpy(), expected)


@pytest.mark.parametrize("fmt", sorted(K_QUANTIZERS))
def test_k_quant_dequantize_equals_gguf_bit_for_bit(fmt):
    """``dequantize_k`` (torch ops, on the weight's device: the embedding lookups and the reference of the
    Triton GEMM) against gguf's numpy formulas, on quantized weights and on arbitrary bytes (every bit of
    the scale packing, including fp16 scales that are inf or NaN)."""
    weight, _ = make_weight(fmt, 6, 512, seed=5)
    noise = torch.randint(0, 256, tuple(weight.data.shape), generator=torch.Generator().manual_seed(2))
    for data in (weight.data, noise.to(torch.uint8)):
        ours = dequantize_k(QuantWeight(FORMATS[fmt], data, None, 512)).numpy()
        expected = gguf_dequantize(data.numpy(), GGMLQuantizationType[fmt])
        assert np.array_equal(ours, expected, equal_nan=True)


def test_int8_rows_round_to_their_scale():
    w = torch.randn(6, 70, generator=_gen(4)) * torch.tensor([1.0, 0.0, 3.0, 1e-3, 10.0, 0.5])[:, None]
    q = quantize_int8(w)
    assert q.data.shape == (6, 70) and q.scales.shape == (6,)
    assert torch.equal(q.scales[1], torch.tensor(1.0)) and not q.data[1].any()  # all-zero row
    err = (dequantize(q) - w).abs()
    assert bool((err <= q.scales[:, None] / 2 + 1e-7).all())
    assert int(q.data.view(torch.int8).abs().max()) == 127
    unpacked, d, offset = unpack_blocks(q)
    assert unpacked.shape == (6, 3, 32) and not unpacked[:, 2, 6:].any() and not offset.any()
    assert torch.equal(d[:, 0], q.scales)


def test_concat_rows_fuses_projections():
    a, _ = make_weight("Q4_1", 8, 64, seed=1)
    b, _ = make_weight("Q4_1", 4, 64, seed=2)
    fused = concat_rows([a, b])
    assert torch.equal(dequantize(fused), torch.cat([dequantize(a), dequantize(b)]))
    with pytest.raises(ValueError, match="cannot fuse Q8_0"):
        concat_rows([a, make_weight("Q8_0", 4, 64, seed=3)[0]])
    i8 = concat_rows([quantize_int8(torch.ones(2, 5)), quantize_int8(2 * torch.ones(3, 5))])
    assert torch.equal(dequantize(i8), torch.cat([torch.ones(2, 5), 2 * torch.ones(3, 5)]))


def test_linear_refuses_what_it_would_misread(kernels):
    weight, _ = make_weight("Q4_1", 16, 64, seed=5)
    x = torch.zeros(2, 64)
    with pytest.raises(ValueError, match="unknown quantized format 'Q5_K'"):
        kernels.linear(x, weight.data, None, "Q5_K", None)
    with pytest.raises(ValueError, match=r"must be contiguous uint8 \[out, 20\]"):
        kernels.linear(torch.zeros(2, 32), weight.data, None, "Q4_1", None)
    with pytest.raises(ValueError, match="blocks of 32 weights; 40 inputs"):
        kernels.linear(torch.zeros(2, 40), weight.data, None, "Q4_1", None)
    with pytest.raises(ValueError, match="float32 CPU tensor"):
        kernels.linear(x.double(), weight.data, None, "Q4_1", None)
    with pytest.raises(ValueError, match=r"bias must be .*\[16\]"):
        kernels.linear(x, weight.data, None, "Q4_1", torch.zeros(8))
    with pytest.raises(ValueError, match="scales must be None"):
        kernels.linear(x, weight.data, torch.ones(16), "Q4_1", None)
    i8 = quantize_int8(torch.randn(16, 64, generator=_gen(6)))
    with pytest.raises(ValueError, match="needs one float32 scale per output row"):
        kernels.linear(x, i8.data, None, "int8", None)
    with pytest.raises(ValueError, match=r"scales must be .*\[16\]"):
        kernels.linear(x, i8.data, i8.scales[:8].contiguous(), "int8", None)
    assert kernels.linear(torch.zeros(0, 64), i8.data, i8.scales, "int8", None).shape == (0, 16)


def test_kernel_agrees_with_float_linear_on_dequantized_weights(kernels):
    """The quantity the engine relies on: the same logits as F.linear on the dequantized matrix (what the
    float32 path of a GGUF model computes), up to summation order."""
    weight, _ = make_weight("Q4_1", 576, 576, seed=9)
    x = torch.randn(3, 576, generator=_gen(9))
    torch.testing.assert_close(
        kernels.linear(x, weight.data, None, "Q4_1", None),
        F.linear(x, dequantize(weight)),
        atol=2e-5,
        rtol=2e-5,
    )


# K-quants: 256-weight super-blocks (eight of the kernels' 32-weight blocks each); 1280 and 1536 inputs
# cross the slab schedule's 512-input slices mid-super-block
K_SHAPES = [
    (1, 33, 256),
    (2, 8, 512),
    (3, 7, 768),
    (4, 17, 256),
    (5, 16, 512),
    (13, 40, 1280),
    (64, 24, 1536),
]


@pytest.mark.parametrize("fmt", sorted(K_QUANTIZERS))
@pytest.mark.parametrize("rows, out_features, in_features", K_SHAPES)
def test_k_quant_kernel_matches_gguf_dequantization(kernels, fmt, rows, out_features, in_features):
    """Q4_K / Q6_K products equal x @ W^T with W dequantized by gguf (llama.cpp's formulas in numpy), in
    both schedules and every build."""
    weight, source = make_weight(fmt, out_features, in_features, seed=rows + in_features)
    dense = torch.from_numpy(gguf_dequantize(weight.data.numpy(), GGMLQuantizationType[fmt]))
    assert (dense - source).abs().max() < 0.1 * source.abs().max()  # the test's writer made valid blocks
    g = _gen(rows)
    x = torch.randn(rows, in_features + 3, generator=g)[:, :in_features]
    bias = torch.randn(out_features, generator=g)
    expected = (x.double() @ dense.double().T + bias.double()).float()
    torch.testing.assert_close(
        kernels.linear(x, weight.data, None, fmt, bias), expected, atol=2e-5, rtol=2e-5
    )
    torch.testing.assert_close(reference_quant_linear(x, weight, bias), expected, atol=2e-5, rtol=2e-5)
    out = torch.empty(out_features, in_features)
    kernels.dequantize(weight.data, None, fmt, in_features, out)
    assert torch.equal(out, dense)  # the C dequantization is gguf's, bit for bit
    assert torch.equal(dequantize(weight), dense)


def test_k_quant_rows_must_hold_whole_super_blocks(kernels):
    weight, _ = make_weight("Q4_K", 4, 256, seed=1)
    with pytest.raises(ValueError, match="blocks of 256 weights; 288 inputs do not fit"):
        FORMATS["Q4_K"].row_bytes(288)
    with pytest.raises(ValueError, match="Q4_K data for 512 inputs"):
        kernels.linear(torch.randn(1, 512), weight.data, None, "Q4_K", None)
