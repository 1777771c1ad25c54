"""The Triton quantized GEMM (``quant_triton``) against the block-wise PyTorch reference, in the Triton
interpreter (or on a GPU with ``KVPILOT_TEST_DEVICE=cuda``): every format (the K-quants' super-blocks
too), float32 and float16 inputs,
tiles with fewer rows / columns than the 16 x 32 tile, several K steps, int8 rows whose length is not a
multiple of 32, with and without bias."""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from gguf_files import K_QUANTIZERS

from kvpilot.engine.model import quant_triton
from kvpilot.engine.model.quant_formats import QuantWeight, quantize_int8
from kvpilot.engine.native.quant_ops import FORMATS
from kvpilot.engine.native.reference import reference_quant_linear

pytestmark = pytest.mark.triton

#: absolute tolerance on outputs of magnitude ~1 (float16: the inputs and the dequantized weights round)
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}


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
