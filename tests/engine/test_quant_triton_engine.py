"""The engine serving a GGUF's blocks through the Triton GEMM (``linear_backend='triton'``: what CUDA runs
by default; here in the Triton interpreter, or on a GPU with ``KVPILOT_TEST_DEVICE=cuda``) generates the
dequantized float path's greedy tokens (``quantization='none'``, same dtype), with its logits and logprobs
within a stated tolerance.

Both bundled tiny GGUFs: every 32-weight format (Q4_0 q/k/v, Q4_1, Q8_0 and a tied Q8_0 head) and the
Q4_K_M mix (Q4_K with Q6_K value/down projections and head, the fused q/k/v split by format). The
weights are the same values either way (the kernel dequantizes in gguf's float32 order), so in float32
logits and logprobs agree to 1e-4 (summation order); in float16 both paths round the same weights and
activations, and logprobs agree to 1e-2 (measured: 4e-3). A prompt of 20 tokens makes the prefill GEMMs a
32-row tile.
"""

# Before any kernel module is imported: sets TRITON_INTERPRET=1 on CPU (collection imports this first).
from triton_device import DEVICE  # isort: skip

from pathlib import Path

import pytest
import torch
from engine_runs import record_step_logits
from quantized_ggufs import write_k_quant_gguf, write_mixed_gguf

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.loader import resolve_linear_backend
from kvpilot.engine.model.quant_linear import QuantEmbedding, QuantLinear, SplitQuantLinear
from kvpilot.engine.model.quantization import resolve_quantization

pytestmark = pytest.mark.triton

ENGINE_ARGS = {
    "device": DEVICE.type,
    "block_size": 16,
    "num_kv_blocks": 16,
    "max_num_batched_tokens": 32,
    "max_num_seqs": 2,
    "native_cpu_ops": "off",  # PyTorch ops on both sides: no C build in this file's cost
}
PROMPTS = [[(7 * i + 3) % 250 + 5 for i in range(20)], [11, 12, 13]]
#: on logits and logprobs of magnitude ~1-5: float32 differs by summation order only, float16 by where
#: each path rounds its products and sums
TOLERANCE = {"float32": 1e-4, "float16": 1e-2}


def greedy(model: Path, **kwargs) -> tuple[LLM, list[list[int]], list[float], list[torch.Tensor]]:
    """Greedy tokens of ``PROMPTS``, their logprobs, and the logits of every step."""
    llm = LLM(str(model), **ENGINE_ARGS, **kwargs)
    logits = record_step_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=0)
    outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    logprobs = [step[t].logprob for o in outs for step, t in zip(o.logprobs, o.token_ids, strict=True)]
    return llm, [o.token_ids for o in outs], logprobs, logits


def quant_layers(llm: LLM) -> list[QuantLinear]:
    return [m for m in llm.engine.model.modules() if isinstance(m, QuantLinear)]


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory) -> dict[str, Path]:
    return {
        "mixed": write_mixed_gguf(tmp_path_factory.mktemp("mixed")),
        "q4_k_m": write_k_quant_gguf(tmp_path_factory.mktemp("q4_k_m")),
    }


@pytest.mark.parametrize(
    "name, formats, dtype",
    [
        ("mixed", {"Q4_0", "Q4_1", "Q8_0"}, "float32"),
        ("q4_k_m", {"Q4_K", "Q6_K"}, "float32"),
        ("mixed", {"Q4_0", "Q4_1", "Q8_0"}, "float16"),
        ("q4_k_m", {"Q4_K", "Q6_K"}, "float16"),
    ],
)
def test_triton_gemm_on_gguf_blocks_generates_the_float_paths_tokens(ggufs, name, formats, dtype):
    quant, tokens, logprobs, logits = greedy(
        ggufs[name], dtype=dtype, quantization="gguf", linear_backend="triton"
    )
    reference, ref_tokens, ref_logprobs, ref_logits = greedy(
        ggufs[name], dtype=dtype, quantization="none", linear_backend="torch"
    )
    assert quant.engine.quantization == "gguf" and reference.engine.quantization == "none"
    layers = quant_layers(quant)
    assert {layer.format for layer in layers} == formats and all(layer.triton for layer in layers)
    model = quant.engine.model
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.packed_lm_head.triton
    if name == "q4_k_m":
        assert isinstance(model.layers[0].self_attn.qkv_proj, SplitQuantLinear)
    assert all(len(t) == 3 for t in tokens) and tokens == ref_tokens
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=tolerance, rtol=0)
    assert len(logits) == len(ref_logits)
    for ours, expected in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=tolerance, rtol=0)


def test_int8_on_the_triton_gemm_computes_the_cpu_paths_int8(tiny_model_dir):
    """``quantization='int8'`` quantizes at load the same way under either backend; the Triton GEMM on
    those rows gives the PyTorch int8 path's tokens and logprobs (float32)."""
    quant, tokens, logprobs, logits = greedy(
        tiny_model_dir, dtype="float32", quantization="int8", linear_backend="triton"
    )
    reference, ref_tokens, ref_logprobs, ref_logits = greedy(
        tiny_model_dir, dtype="float32", quantization="int8", linear_backend="torch"
    )
    layers = quant_layers(quant)
    assert layers and all(layer.format == "int8" and layer.triton for layer in layers)
    assert not any(layer.triton for layer in quant_layers(reference))
    assert tokens == ref_tokens
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(ref_logprobs), atol=1e-4, rtol=0)
    for ours, expected in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=0)


def test_the_triton_gemm_is_chosen_by_the_linear_backend(ggufs, monkeypatch):
    """``linear_backend`` picks the kernel: ``auto`` is ``triton`` on CUDA, where ``quantization='auto'``
    then keeps a GGUF's blocks at any float dtype; without it a bfloat16 GGUF is refused or dequantized.
    On CPU, ``triton`` needs the interpreter."""
    path, cpu, cuda = ggufs["mixed"], torch.device("cpu"), torch.device("cuda")
    assert resolve_linear_backend("auto", cuda, torch.bfloat16) == "triton"
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert resolve_quantization("auto", path, cuda, dtype, None, linear_backend="triton") == "gguf"
    assert resolve_quantization("auto", path, cuda, torch.bfloat16, None, linear_backend="torch") == "none"
    assert resolve_quantization("int8", None, cuda, torch.bfloat16, None, linear_backend="triton") == "int8"
    with pytest.raises(ValueError, match="use linear_backend='triton'"):
        resolve_quantization("gguf", path, cuda, torch.bfloat16, None, linear_backend="torch")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="linear_backend 'triton' on CPU runs only in Triton's interpreter"):
        resolve_linear_backend("triton", cpu, torch.float32)
