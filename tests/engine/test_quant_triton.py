"""The Triton quantized GEMM (``quant_triton``) against the block-wise PyTorch reference, in the Triton
interpreter (or on a GPU with ``KVPILOT_TEST_DEVICE=cuda``): every format (the K-quants' super-blocks
too), float32 and float16 inputs, tiles with fewer rows / columns than the tile (16 to 64 rows by batch,
64 columns), several K steps, int8 rows whose length is not a multiple of 32, with and without bias; and
the engine's quantized layers on it."""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from gguf_files import K_QUANTIZERS

from kvpilot.engine.model import quant_triton
from kvpilot.engine.model.quant_formats import QuantWeight, dequantize, quantize_int8
from kvpilot.engine.model.quant_linear import QuantEmbedding, SplitQuantLinear
from kvpilot.engine.native.quant_ops import FORMATS
from kvpilot.engine.native.reference import reference_quant_linear

pytestmark = pytest.mark.triton

#: absolute tolerance on outputs of magnitude ~1 (float16 / bfloat16: the inputs and the dequantized
#: weights round to 11 / 8 significant bits)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}
#: the interpreter's bfloat16 ``tl.dot`` is wrong: those cases run on a GPU only
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda", reason="bfloat16 tl.dot needs a GPU")


def make_weight(fmt: str, out_features: int, in_features: int, seed: int) -> QuantWeight:
    w = (
        torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))
        / in_features**0.5
    )
    if fmt == "int8":
        return quantize_int8(w)
    if fmt in K_QUANTIZERS:
        blocks = K_QUANTIZERS[fmt](w.numpy())
    else:
        blocks = gguf_quantize(w.numpy(), GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(blocks), None, in_features)


CASES = [
    ("Q4_0", torch.float32, 1, 16, 32, False),
    ("Q4_1", torch.float16, 5, 40, 96, True),
    ("Q8_0", torch.float32, 17, 33, 64, True),
    ("Q4_1", torch.float32, 3, 64, 128, False),
    ("int8", torch.float16, 2, 20, 45, True),
    ("int8", torch.float32, 18, 48, 70, False),
    ("Q8_0", torch.float16, 16, 32, 32, False),
    # K-quants: every sub-block of a super-block (its 6-bit scale packing differs below and above 4),
    # two super-blocks per row, a partial tile of columns
    ("Q4_K", torch.float32, 3, 40, 512, True),
    ("Q4_K", torch.float16, 17, 32, 256, False),
    ("Q6_K", torch.float32, 1, 24, 512, False),
    ("Q6_K", torch.float16, 5, 48, 256, True),
    ("Q4_1", torch.float32, 0, 16, 64, True),  # an empty batch: no launch, an empty result
    # prefill-sized batches: 32- and 64-row tiles, the last one partial
    ("Q4_K", torch.float32, 40, 64, 256, False),
    ("Q8_0", torch.float16, 150, 16, 64, True),
    pytest.param("Q4_K", torch.bfloat16, 7, 64, 512, True, marks=ON_GPU),
    pytest.param("Q6_K", torch.bfloat16, 70, 40, 256, False, marks=ON_GPU),
    pytest.param("Q4_0", torch.bfloat16, 1, 32, 96, False, marks=ON_GPU),
]


@pytest.mark.parametrize("fmt, dtype, rows, out_features, in_features, with_bias", CASES)
def test_triton_quant_linear_matches_reference(fmt, dtype, rows, out_features, in_features, with_bias):
    weight = make_weight(fmt, out_features, in_features, seed=rows + in_features)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    bias = torch.randn(out_features, generator=g) if with_bias else None
    expected = reference_quant_linear(x.float(), weight, bias)
    dev = weight.to(DEVICE)
    got = quant_triton.quant_linear(
        x.to(DEVICE), dev.data, dev.scales, fmt, None if bias is None else bias.to(DEVICE)
    )
    assert got.dtype == dtype and got.shape == (rows, out_features)
    torch.testing.assert_close(got.float().cpu(), expected, atol=TOLERANCE[dtype], rtol=0)


def test_triton_quant_linear_refuses_what_it_would_misread():
    weight = make_weight("Q4_1", 16, 64, seed=1)
    with pytest.raises(ValueError, match="unknown quantized format"):
        quant_triton.quant_linear(torch.zeros(1, 64), weight.data, None, "Q5_K", None)
    with pytest.raises(ValueError, match="Q6_K rows hold blocks of 256 weights; 64 inputs do not fit"):
        quant_triton.quant_linear(torch.zeros(1, 64), weight.data, None, "Q6_K", None)
    with pytest.raises(ValueError, match=r"x must be 2-D float32, float16 or bfloat16, got torch\.int32"):
        quant_triton.quant_linear(torch.zeros(1, 64, dtype=torch.int32), weight.data, None, "Q4_1", None)
    with pytest.raises(ValueError, match="rows of 32 inputs are 20 bytes"):
        quant_triton.quant_linear(torch.zeros(1, 32), weight.data, None, "Q4_1", None)
    with pytest.raises(ValueError, match="takes no row scales"):
        quant_triton.quant_linear(torch.zeros(1, 64), weight.data, torch.ones(16), "Q4_1", None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quant_layers_on_the_triton_gemm_match_the_reference(dtype):
    """The layers the engine builds with ``linear_backend='triton'``: a fused projection of a Q4_K and a
    Q6_K part with one bias over both, fed 3-D activations in ``dtype``, and a tied LM head over a Q8_0
    embedding whose rows come back in the model's dtype."""
    parts = [make_weight("Q4_K", 40, 256, seed=1), make_weight("Q6_K", 24, 256, seed=2)]
    # native kernels handed in too (an object without any: calling one would fail): the Triton GEMM runs,
    # and the layer offers no native kernel to a C path (``native`` None)
    fused = SplitQuantLinear(parts, has_bias=True, native=object(), triton=True)
    assert all(part.native is None for part in fused.parts)
    fused.bias.copy_(torch.linspace(-1, 1, 64))
    table = make_weight("Q8_0", 48, 64, seed=3)
    embedding = QuantEmbedding(table, dtype)
    head = embedding.as_linear(None, triton=True)
    fused, embedding, head = fused.to(DEVICE), embedding.to(DEVICE), head.to(DEVICE)
    x = torch.randn(2, 9, 256, generator=torch.Generator().manual_seed(4)).to(dtype)
    expected = torch.cat([reference_quant_linear(x.view(18, 256).float(), p, None) for p in parts], dim=-1)
    got = fused(x.to(DEVICE))
    assert got.dtype == dtype and got.shape == (2, 9, 64)
    torch.testing.assert_close(got.view(18, 64).float().cpu(), expected + fused.bias.cpu(), **close(dtype))
    ids = torch.tensor([0, 47, 5])
    rows = embedding(ids.to(DEVICE))
    assert rows.dtype == dtype
    torch.testing.assert_close(rows.cpu(), dequantize(table)[ids].to(dtype), atol=0, rtol=0)
    logits = head(rows)
    expected = reference_quant_linear(rows.float().cpu(), table, None)
    torch.testing.assert_close(logits.float().cpu(), expected, **close(dtype))


def close(dtype: torch.dtype) -> dict[str, float]:
    """Tolerance on sums of 64-256 products of magnitude ~1 (float16: the inputs round to 11 bits)."""
    return {"atol": 2e-4 if dtype == torch.float32 else 5e-2, "rtol": 0}
