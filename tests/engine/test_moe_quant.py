"""Routed experts kept in GGUF blocks (``moe_quant.QuantExperts``) against the dequantized reference
(``moe_experts.reference_moe`` on the blocks' float values), and MoE GGUFs with quantized experts served
under ``quantization=gguf`` (docs/models.md#gguf).

The kernel cases: Q4_0, Q4_1 and Q8_0; 8 experts top-2 and 64 experts top-8; with the native kernels
(their quantized GEMM for an expert's first 64 rows, dequantized slices and torch's GEMM beyond: the hot
expert of the 150-token case has more) and without (PyTorch dequantization); uneven token counts and
experts no token chose, whose blocks are poisoned with NaN scales so reading one would show; and the
K-quants Q4_K / Q6_K on layers of whole 256-weight super-blocks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from gguf_family_files import write_family_gguf
from gguf_files import K_QUANTIZERS, write_llama_gguf
from moe_models import PROMPT, STEPS, write_moe_model

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.moe_experts import reference_moe, select_experts
from kvpilot.engine.model.moe_quant import QuantExperts
from kvpilot.engine.model.quant_formats import QuantWeight
from kvpilot.engine.model.quant_linear import QUANT_NATIVE_MAX_ROWS
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.native.ops import load_native_ops
from kvpilot.engine.native.quant_ops import FORMATS

HIDDEN, INTER = 64, 96
ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe"}
#: outputs are ~1; the paths differ from the reference only in float32 summation order
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def native():
    return load_native_ops(default_cache_dir())


def blocks(weight: torch.Tensor, fmt: str) -> QuantWeight:
    data = gguf_quantize(weight.numpy(), GGMLQuantizationType[fmt])
    return QuantWeight(FORMATS[fmt], torch.from_numpy(data), None, weight.shape[1])


def make_experts(fmt: str, experts: int, native, seed: int) -> QuantExperts:
    g = torch.Generator().manual_seed(seed)
    gate_up = [blocks(torch.randn(2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5, fmt) for _ in range(experts)]
    down = [blocks(torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5, fmt) for _ in range(experts)]
    return QuantExperts(gate_up, down, native)


def routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A routing with one hot expert (expert 1) and the last quarter of the experts never chosen."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 1] += 4.0
    empty = list(range(experts - experts // 4, experts))
    logits[:, empty] = -1e4
    weights, ids = select_experts(logits, top_k, renormalize=True)
    return weights, ids, empty


def poison(experts: QuantExperts, unused: list[int]) -> None:
    """NaN block scales (fp16 0x7E00 in each block's first two bytes) in the experts no token chose."""
    for e in unused:
        for layer in (experts.gate_up[e], experts.down[e]):
            fmt = FORMATS[layer.format]
            raw = layer.qweight.view(layer.out_features, -1, fmt.block_bytes)
            raw[..., 0], raw[..., 1] = 0x00, 0x7E


@pytest.mark.parametrize("with_native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("experts, top_k, tokens", [(8, 2, 37), (64, 8, 19), (8, 2, 150)])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
def test_quantized_experts_match_the_dequantized_reference(native, fmt, experts, top_k, tokens, with_native):
    ops = native if with_native else None
    layer = make_experts(fmt, experts, ops, seed=experts + top_k)
    w13, w2 = layer.dequantized()  # before the unused experts are poisoned
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    weights, ids, unused = routing(tokens, experts, top_k, seed=tokens + top_k)
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert all(counts[e] == 0 for e in unused) and counts.min() < counts.max()
    if tokens == 150:  # the hot expert takes the sliced-dequantization path
        assert counts.max() > QUANT_NATIVE_MAX_ROWS
    poison(layer, unused)
    want = reference_moe(x, w13, w2, weights, ids)
    got = layer(x, weights, ids, ops)
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < TOLERANCE


def test_quantized_experts_refuse_mismatched_shapes(native):
    layer = make_experts("Q8_0", 2, native, seed=0)
    with pytest.raises(ValueError, match=r"\[192, 64\] / \[192, 64\] do not fit hidden 64"):
        QuantExperts([layer.gate_up[0].weight_q], [layer.gate_up[1].weight_q], native)
    weights, ids, _ = routing(4, 8, 2, seed=0)
    with pytest.raises(ValueError, match="routing names expert"):
        layer(torch.randn(4, HIDDEN), weights, ids, native)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_a_moe_gguf_serves_its_q8_experts_as_blocks(tmp_path: Path, family: str) -> None:
    """Q8_0 experts (and attention) kept as blocks under ``quantization=gguf`` give the greedy tokens of
    the same file dequantized (``quantization=none``); so does Qwen2-MoE's Q8_0 shared expert."""
    experts = tuple(f"blk.{i}.ffn_{p}_exps.weight" for i in (0, 1) for p in ("gate", "up", "down"))
    attention = tuple(f"blk.{i}.attn_{p}.weight" for i in (0, 1) for p in "qkv")
    gguf_path = tmp_path / f"{family}-q8.gguf"
    if family == "qwen2_moe":  # llama.cpp's qwen2moe has every layer sparse
        source = write_moe_model(tmp_path / "source", family, seed=4, mlp_only_layers=[])
        # its down projection's 48 inputs are no whole Q8_0 blocks: it stays F32 (and float)
        shared = tuple(f"blk.{i}.ffn_{p}_shexp.weight" for i in (0, 1) for p in ("gate", "up"))
        write_family_gguf(gguf_path, source, types=dict.fromkeys(experts + attention + shared, "Q8_0"))
    else:
        source = write_moe_model(tmp_path / "source", family, seed=4)
        write_llama_gguf(gguf_path, source, quantized=experts + attention, arch=ARCH[family])
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    tokens = {}
    for mode in ("gguf", "none"):
        args = {"dtype": "float32", "num_kv_blocks": 64, "block_size": 8, "activation_quantization": "none"}
        llm = LLM(str(gguf_path), quantization=mode, **args)  # float32 activations: exact products
        block = llm.engine.model.layers[0].mlp
        assert (block.quant_experts is not None) == (mode == "gguf")
        if mode == "gguf":
            assert block.w13.numel() == 0 and block.quant_experts.gate_up[0].format == "Q8_0"
        if family == "qwen2_moe":  # its shared expert keeps its blocks too
            shared = type(block.shared_expert.gate_up_proj).__name__
            assert (shared == "QuantLinear") == (mode == "gguf")
        tokens[mode] = llm.generate([PROMPT], params)[0].outputs[0].token_ids
    assert tokens["gguf"] == tokens["none"]


@pytest.mark.parametrize("with_native", [True, False], ids=["native", "pytorch"])
@pytest.mark.parametrize("fmt", sorted(K_QUANTIZERS))
def test_k_quant_experts_match_the_dequantized_reference(native, fmt, with_native):
    """Q4_K / Q6_K experts (llama.cpp's Q4_K_M MoE files): widths of whole 256-weight super-blocks."""
    hidden, inter, experts, top_k, tokens = 256, 512, 8, 2, 37
    ops = native if with_native else None
    g = torch.Generator().manual_seed(9)

    def k_blocks(weight: torch.Tensor) -> QuantWeight:
        data = torch.from_numpy(K_QUANTIZERS[fmt](weight.numpy()))
        return QuantWeight(FORMATS[fmt], data, None, weight.shape[1])

    gate_up = [k_blocks(torch.randn(2 * inter, hidden, generator=g) / hidden**0.5) for _ in range(experts)]
    down = [k_blocks(torch.randn(hidden, inter, generator=g) / inter**0.5) for _ in range(experts)]
    layer = QuantExperts(gate_up, down, ops)
    w13, w2 = layer.dequantized()
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids, _ = routing(tokens, experts, top_k, seed=5)
    assert (layer(x, weights, ids, ops) - reference_moe(x, w13, w2, weights, ids)).abs().max() < TOLERANCE


@pytest.mark.triton
@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_quantized_experts_on_the_triton_gemm_match_the_reference(fmt):
    """``linear_backend='triton'``: each chosen expert's two GEMMs on the Triton kernel (the Triton
    interpreter here, as ``tests/support/triton_device.py`` sets it), unused experts still never read."""
    from triton_device import DEVICE

    g = torch.Generator().manual_seed(9)
    gate_up = [blocks(torch.randn(2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5, fmt) for _ in range(8)]
    down = [blocks(torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5, fmt) for _ in range(8)]
    layer = QuantExperts(gate_up, down, None, triton=True)
    w13, w2 = layer.dequantized()
    x = torch.randn(21, HIDDEN, generator=g)
    weights, ids, unused = routing(21, 8, 2, seed=5)
    poison(layer, unused)
    want = reference_moe(x, w13, w2, weights, ids)
    got = layer.to(DEVICE)(x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)).cpu()
    assert torch.isfinite(got).all()
    assert (got - want).abs().max() < TOLERANCE
