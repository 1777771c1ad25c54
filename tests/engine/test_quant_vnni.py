"""The int8-activation GEMM (``quant_vnni.c``'s AVX-512 VNNI kernel, ``quant_vnni_avx2.c``'s AVX2 one)
against their PyTorch reference, and the reference against the float product of the same weights.

Every packable format (GGUF Q4_0 / Q4_1 / Q8_0 blocks made by gguf's quantizer, Q4_K super-blocks made by
tests/support/k_quants.py, kvpilot's int8 rows); row counts around the kernel's 6-row chunks, outputs that
end mid-tile (16 rows) or mid-half (8 rows, AVX2), strided input rows, with and without bias. On an AVX-512
VNNI host both kernels run (the AVX2 one from a ``-mno-avx512f`` build); skipped on a CPU with neither (the
engine then keeps the float32 kernels).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from gguf_files import K_QUANTIZERS

from kvpilot.engine.model.quant_formats import QuantWeight, dequantize, quantize_int8
from kvpilot.engine.native import ops as native
from kvpilot.engine.native.quant_ops import FORMATS
from kvpilot.engine.native.reference import (
    reference_quant_linear,
    reference_vnni_linear,
    reference_vnni_quantize,
)

FORMATS_PACKED = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "int8")


@pytest.fixture(scope="module")
def host_build(tmp_path_factory):
    return native.load_native_ops(tmp_path_factory.mktemp("native")).vnni


@pytest.fixture(scope="module", params=["native", "avx2"])
def vnni(request, host_build, tmp_path_factory):
    """This host's kernel, and on an AVX-512 VNNI host the AVX2 one too."""
    kernels = host_build
    if request.param == "avx2":
        if host_build.isa != "avx512-vnni":
            pytest.skip("this host's own build is its AVX2 kernel already (or it has none)")
        kernels = native.load_native_ops(tmp_path_factory.mktemp("avx2"), ("-mno-avx512f",)).vnni
        assert kernels.isa == "avx2"
    if not kernels.available:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    return kernels


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_weight(fmt: str, out_features: int, in_features: int, seed: int) -> QuantWeight:
    """A quantized random weight with one all-zero row and, for int8, one row of tiny weights (its scale
    an fp16 subnormal)."""
    w = torch.randn(out_features, in_features, generator=_gen(seed)) / in_features**0.5
    w[min(1, out_features - 1)] = 0.0
    if fmt == "int8":
        w[min(2, out_features - 1)] *= 1e-4
        return quantize_int8(w)
    if fmt in K_QUANTIZERS:
        return QuantWeight(FORMATS[fmt], torch.from_numpy(K_QUANTIZERS[fmt](w.numpy())), None, in_features)
    blocks = gguf_quantize(w.numpy(), GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(blocks), None, in_features)


# (rows, out_features, in_features): 1-6 rows are one chunk, 7+ several with a remainder; 16-row tiles
# whole and cut (7, 40, 33 outputs); Q4_K needs 256-input super-blocks
SHAPES = [
    (1, 576, 576),
    (2, 33, 64),
    (3, 7, 96),
    (4, 16, 32),
    (5, 40, 256),
    (9, 50, 288),
    (13, 24, 64),
    (67, 96, 1536),
]
K_SHAPES = [(1, 40, 256), (6, 33, 512), (17, 16, 768)]


def _cases():
    for fmt in FORMATS_PACKED:
        shapes = K_SHAPES if fmt == "Q4_K" else SHAPES
        for i, shape in enumerate(shapes):
            yield pytest.param(fmt, *shape, i % 2 == 0, id=f"{fmt}-{'x'.join(map(str, shape))}")


@pytest.mark.parametrize("fmt, rows, out_features, in_features, with_bias", list(_cases()))
def test_kernel_matches_reference(vnni, fmt, rows, out_features, in_features, with_bias):
    weight = make_weight(fmt, out_features, in_features, seed=rows * out_features + in_features)
    g = _gen(rows)
    x = torch.randn(rows, in_features + 5, generator=g)[:, :in_features]  # strided rows
    x[0, :32] = 0.0  # an all-zero activation block: scale 0
    bias = torch.randn(out_features, generator=g) if with_bias else None
    packed = vnni.pack(weight.data, weight.scales, fmt, in_features)
    got = vnni.linear(x, packed, bias)
    torch.testing.assert_close(got, reference_vnni_linear(x, weight, bias), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rows, in_features", [(1, 32), (3, 576), (8, 1536)])
def test_activation_rounding_matches_reference(vnni, rows, in_features):
    x = torch.randn(rows, in_features, generator=_gen(in_features)) * 3
    x[0, 32:64] = 0.0 if in_features > 32 else x[0, 32:64]
    x[-1, 5] = 1e4  # one outlier: its block's other codes round to 0
    codes, dx, sx = vnni.quantize(x)
    ref_codes, ref_dx, ref_sx = reference_vnni_quantize(x)
    assert torch.equal(codes, ref_codes) and torch.equal(dx, ref_dx)
    torch.testing.assert_close(sx, ref_sx, rtol=0, atol=0)
    assert int(codes.abs().max()) == 127


@pytest.mark.parametrize("fmt", FORMATS_PACKED)
def test_reference_is_close_to_the_float_product(fmt):
    """The int8 rounding of the activations moves a product by well under 1% of its size (relative RMS)
    for Gaussian inputs; the reference without that rounding would be the float kernel's result."""
    in_features = 512
    weight = make_weight(fmt, 64, in_features, seed=3)
    x = torch.randn(4, in_features, generator=_gen(5))
    exact = reference_quant_linear(x, weight, None)
    err = (reference_vnni_linear(x, weight, None) - exact).norm() / exact.norm()
    assert 1e-4 < float(err) < 1e-2, float(err)


def test_q4_k_scales_unpack_to_its_dequantization():
    """Q4_K's sub-block scales and offsets (what the tiles hold) give gguf-faithful dequantized weights."""
    from kvpilot.engine.model.quant_formats import unpack_blocks

    weight = make_weight("Q4_K", 8, 512, seed=9)
    q, d, offset = unpack_blocks(weight)
    assert q.shape == (8, 16, 32) and int(q.max()) <= 15
    assert torch.equal((d[..., None] * q + offset[..., None]).reshape(8, -1), dequantize(weight))


def test_refuses_what_it_cannot_pack(vnni):
    q6 = make_weight("Q4_1", 16, 64, seed=1)
    with pytest.raises(ValueError, match="no int8-activation kernel"):
        vnni.pack(q6.data, None, "Q6_K", 64)
    odd = quantize_int8(torch.randn(4, 40))
    assert not vnni.packable("int8", 40) and vnni.packable("int8", 64)
    with pytest.raises(ValueError, match="whole 32-input blocks"):
        vnni.pack(odd.data, odd.scales, "int8", 40)
    packed = vnni.pack(q6.data, None, "Q4_1", 64)
    with pytest.raises(ValueError, match="64 columns"):
        vnni.linear(torch.randn(2, 32), packed, None)
