"""The Triton W8A16 GEMM on e4m3 weights (``fp8_triton``) against ``dequantize_fp8`` and a float64 matmul, in
the Triton interpreter (or on a GPU with ``KVPILOT_TEST_DEVICE=cuda``): every e4m3 code decodes to torch's
value (subnormals, signed zeros, NaN); per-tensor, per-row and block-wise scales (a group size that does not
divide K); float32 and float16 inputs; tiles with fewer rows / columns than the tile; bias. Then the engine
with ``quantization='fp8'`` on ``linear_backend='triton'`` generates the dequantize-per-call path's tokens.
The W8A8 GEMM (e4m3 activations, ``tl.dot`` on e4m3 tiles) against the same float64 matmul of the rounded
activations, and the engine on it (``activation_quantization='fp8'``)."""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

import pytest
import torch

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.fp8_linear import FP8_DTYPE, Fp8Linear, Fp8Weight, dequantize_fp8, quantize_fp8
from kvpilot.engine.model.fp8_triton import fp8_linear, fp8_w8a8_linear, quantize_fp8_rows

pytestmark = pytest.mark.triton

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2}


def test_every_e4m3_code_decodes_to_torchs_value():
    codes = torch.arange(256, dtype=torch.uint8)
    data = codes[:, None].expand(256, 16).contiguous().view(FP8_DTYPE).to(DEVICE)  # row n: code n
    eye = torch.eye(16, device=DEVICE)  # y[m, n] = w[n, m]: each decoded weight, multiplied by one
    y = fp8_linear(eye, data, torch.ones(256, 1, device=DEVICE), 16, None).cpu()
    expected = codes.view(FP8_DTYPE).float()
    assert torch.equal(y[0].isnan(), expected.isnan()) and int(expected.isnan().sum()) == 2
    finite = ~expected.isnan()
    assert torch.equal(y[0][finite], expected[finite])
    assert torch.equal(y[5][finite], expected[finite])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["tensor", "row", "block-48"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 40, 96), (20, 70, 160)])
def test_matches_the_dequantized_matmul(dtype, scales, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    x = torch.randn(rows, in_features, generator=g)
    bias = torch.randn(out_features, generator=g)
    weight = quantize_fp8(w)
    if scales == "tensor":
        weight = Fp8Weight(weight.data, torch.full((out_features, 1), 0.004), in_features)
    elif scales == "block-48":  # 48 does not divide 160: the last group is short
        groups = -(-in_features // 48)
        block = torch.rand(out_features, groups, generator=g) * 0.01 + 0.001
        weight = Fp8Weight(weight.data, block, 48)
    reference = (x.double() @ dequantize_fp8(weight).double().t() + bias.double()).float()
    y = fp8_linear(
        x.to(DEVICE, dtype), weight.data.to(DEVICE), weight.scales.to(DEVICE), weight.block_k, bias.to(DEVICE)
    )
    assert y.dtype == dtype and y.shape == (rows, out_features)
    torch.testing.assert_close(y.float().cpu(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


def test_bad_layouts_are_refused():
    weight = quantize_fp8(torch.randn(8, 32))
    x = torch.randn(2, 32)
    with pytest.raises(ValueError, match="data must be contiguous float8_e4m3fn"):
        fp8_linear(x, weight.data.float(), weight.scales, 32, None)
    with pytest.raises(ValueError, match=r"scales must be contiguous float32 \[8, 2\]"):
        fp8_linear(x, weight.data, weight.scales, 16, None)
    with pytest.raises(ValueError, match="x must be 2-D"):
        fp8_linear(x.double(), weight.data, weight.scales, 32, None)
    assert fp8_linear(x[:0], weight.data, weight.scales, 32, None).shape == (0, 8)


def test_the_engine_on_the_kernel_generates_the_dequantized_paths_tokens(tiny_model_dir):
    llm = LLM(
        str(tiny_model_dir),
        device=DEVICE.type,
        quantization="fp8",
        linear_backend="triton",
        native_cpu_ops="off",
        block_size=16,
        num_kv_blocks=16,
        max_num_seqs=2,
    )
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.triton for m in layers)
    prompts = [[(7 * i + 3) % 250 + 5 for i in range(20)], [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=0)

    def run() -> tuple[list[list[int]], list[float]]:
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        lps = [step[t].logprob for o in outs for step, t in zip(o.logprobs, o.token_ids, strict=True)]
        return [o.token_ids for o in outs], lps

    kernel_tokens, kernel_logprobs = run()
    for m in layers:
        m.triton = False  # the same weights, dequantized per call
    dequantized_tokens, dequantized_logprobs = run()
    assert kernel_tokens == dequantized_tokens
    assert max(abs(a - b) for a, b in zip(kernel_logprobs, dequantized_logprobs, strict=True)) < 1e-4


def test_rows_round_to_e4m3_with_one_scale_each():
    x = torch.tensor([[1.0, -2.0, 0.5, 448.0 / 4], [0.0, 0.0, 0.0, 0.0], [3e-3, -1e-3, 2e-3, 1e-4]])
    codes, scales = quantize_fp8_rows(x)
    assert codes.dtype == FP8_DTYPE and scales.tolist()[1] == 0.0
    assert torch.equal(codes[1].float(), torch.zeros(4))
    assert torch.equal(codes.float().abs().amax(dim=1)[[0, 2]], torch.tensor([448.0, 448.0]))
    torch.testing.assert_close(codes.float() * scales[:, None], x, rtol=2**-3, atol=1e-6)  # 3 mantissa bits


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("scales", ["tensor", "row", "block-64", "block-128"])
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 40, 96), (20, 70, 160), (3, 16, 256)])
def test_w8a8_matches_the_matmul_of_rounded_activations(dtype, scales, rows, out_features, in_features):
    g = torch.Generator().manual_seed(rows * 7 + in_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    x = torch.randn(rows, in_features, generator=g) * 3
    bias = torch.randn(out_features, generator=g)
    weight = quantize_fp8(w)
    if scales == "tensor":
        weight = Fp8Weight(weight.data, torch.full((out_features, 1), 0.004), in_features)
    elif scales.startswith("block-"):
        size = int(scales.removeprefix("block-"))
        groups = -(-in_features // size)
        weight = Fp8Weight(weight.data, torch.rand(out_features, groups, generator=g) * 0.01 + 0.001, size)
    x_dev = x.to(DEVICE, dtype)
    codes, row_scales = quantize_fp8_rows(x_dev)
    rounded = codes.double().cpu() * row_scales.double().cpu()[:, None]
    reference = (rounded @ dequantize_fp8(weight).double().t() + bias.double()).float()
    y = fp8_w8a8_linear(
        x_dev, weight.data.to(DEVICE), weight.scales.to(DEVICE), weight.block_k, bias.to(DEVICE)
    )
    assert y.dtype == dtype and y.shape == (rows, out_features)
    torch.testing.assert_close(y.float().cpu(), reference, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    # the rounding is real: the W8A16 product of the unrounded x differs by more than the tolerance
    w8a16 = fp8_linear(
        x_dev, weight.data.to(DEVICE), weight.scales.to(DEVICE), weight.block_k, bias.to(DEVICE)
    )
    assert float((w8a16.float().cpu() - y.float().cpu()).abs().max()) > 3 * TOLERANCE[dtype]


def test_w8a8_refuses_scale_groups_across_its_k_steps():
    weight = quantize_fp8(torch.randn(8, 160))
    blocks = Fp8Weight(weight.data, torch.ones(8, 4), 48)
    with pytest.raises(ValueError, match="scale groups of 48 inputs"):
        fp8_w8a8_linear(
            torch.randn(2, 160, device=DEVICE), blocks.data.to(DEVICE), blocks.scales.to(DEVICE), 48, None
        )


def test_the_engine_runs_w8a8_close_to_w8a16(tiny_model_dir):
    args = {"quantization": "fp8", "linear_backend": "triton", "native_cpu_ops": "off", "device": DEVICE.type}
    args |= {"block_size": 16, "num_kv_blocks": 16, "max_num_seqs": 2}
    llm = LLM(str(tiny_model_dir), activation_quantization="fp8", **args)
    layers = [m for m in llm.engine.model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.fp8_activations for m in layers) and "triton-w8a8" in repr(layers[0])
    prompt = [(7 * i + 3) % 250 + 5 for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def prompt_logprobs() -> list[float]:
        out = llm.generate([prompt], params)[0]
        return [next(iter(step.values())).logprob for step in out.prompt_logprobs[1:]]

    w8a8 = prompt_logprobs()
    for m in layers:
        m.fp8_activations = False
    w8a16 = prompt_logprobs()
    worst = max(abs(a - b) for a, b in zip(w8a8, w8a16, strict=True))
    assert 1e-5 < worst < 0.5, worst
    with pytest.raises(ValueError, match="runs fp8 weights on the Triton GEMM"):
        LLM(str(tiny_model_dir), activation_quantization="fp8", device="cpu", num_kv_blocks=16)
