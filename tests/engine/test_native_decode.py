"""The decode step in one C call (``model.native_decode``) against the native path layer by layer.

Both run the same kernels in the same order, so every step's logits must be *equal*, not close: for float
and quantized projections (GGUF blocks, a K-quant file's split q/k/v, int8 rows, a float tensor among
quantized ones), biases, a sliding window, another head size and fp8/int8 KV caches. The steps mix
chunked prefills (the layer-by-layer path) with decode-only steps (the C loop), and each test checks that
the C loop really ran them. Models it does not run (q/k norms, MoE) keep the layer path.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from cpu_features import HAS_INT8_KERNEL, NO_INT8_KERNEL
from engine_runs import record_step_logits
from gguf_files import write_llama_gguf
from hf_families import build_family

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.native_decode import NativeDecodeStep
from kvpilot.engine.model.quant_linear import QuantLinear
from kvpilot.engine.model.tiny import write_tiny_llama

ENGINE_ARGS = {"block_size": 4, "num_kv_blocks": 200, "max_num_batched_tokens": 24, "max_num_seqs": 5}
FLOAT_VARIANTS = {
    "llama": {},
    "qwen2-biases": {"model_type": "qwen2"},
    "mistral-window-6": {"model_type": "mistral", "sliding_window": 6},
    "head-dim-32": {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32},
}
Q_TYPES = {"attn_q": "Q4_0", "attn_k": "Q4_0", "attn_v": "Q4_0", "attn_output": "Q4_1"}
Q_TYPES |= {"ffn_gate": "Q8_0", "ffn_up": "Q8_0", "ffn_down": "Q4_1"}
K_TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K"}
K_TYPES |= {"ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}


def prompts() -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 6, 19, 33)]


def run(model: str | Path, fused: bool, **kwargs) -> tuple[list[list[int]], list[torch.Tensor], int]:
    """Greedy tokens, every step's logits, and how many steps the C loop ran."""
    llm = LLM(str(model), **ENGINE_ARGS, **kwargs)
    model_ = llm.engine.model
    if kwargs.get("activation_quantization") == "int8":  # the int8-activation GEMM is what runs
        layers = [m for m in model_.modules() if isinstance(m, QuantLinear)]
        assert layers and all(m.vnni_weight is not None for m in layers if m.format != "Q6_K")
    fused_steps = 0
    if not fused:
        model_.decode_step = False
    else:
        step = NativeDecodeStep.build(model_, llm.engine.native_ops)
        assert step is not None, "this model should run in the C loop"
        run_step = step.run

        def counting(*args):
            nonlocal fused_steps
            fused_steps += 1
            return run_step(*args)

        step.run = counting  # type: ignore[method-assign]
        model_.decode_step = step
    logits = record_step_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=2)
    outs = llm.generate(prompts(), params)
    return [o.outputs[0].token_ids for o in outs], logits, fused_steps


def assert_same_steps(model: str | Path, **kwargs) -> None:
    fused_tokens, fused_logits, fused_steps = run(model, True, **kwargs)
    layer_tokens, layer_logits, _ = run(model, False, **kwargs)
    assert fused_steps >= 4  # the decode-only steps after the prompts
    assert len(fused_logits) > fused_steps  # ... and prefill steps on the layer path
    assert fused_tokens == layer_tokens
    for ours, reference in zip(fused_logits, layer_logits, strict=True):
        assert torch.equal(ours, reference)


@pytest.mark.parametrize("variant", list(FLOAT_VARIANTS))
def test_float_models_decode_bit_for_bit(tmp_path, variant):
    model = write_tiny_llama(tmp_path / "model", seed=3, **FLOAT_VARIANTS[variant])
    assert_same_steps(model)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_quantized_kv_caches_decode_bit_for_bit(tiny_model_dir, kv_cache_dtype):
    assert_same_steps(tiny_model_dir, kv_cache_dtype=kv_cache_dtype)


#: the quantized GEMMs' activations: float32, and int8 where this CPU has the kernel (AVX2 / AVX-512 VNNI)
ACTIVATIONS = [
    "none",
    pytest.param("int8", marks=pytest.mark.skipif(not HAS_INT8_KERNEL, reason=NO_INT8_KERNEL)),
]


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_int8_weights_decode_bit_for_bit(tiny_model_dir, activations):
    assert_same_steps(tiny_model_dir, quantization="int8", activation_quantization=activations)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_gguf_blocks_and_a_float_tensor_decode_bit_for_bit(tmp_path, activations):
    source = write_tiny_llama(tmp_path / "hf", seed=4)
    types = {f"blk.{i}.{part}.weight": t for i in range(2) for part, t in Q_TYPES.items()}
    types |= {"token_embd.weight": "Q8_0", "blk.1.ffn_down.weight": "F16"}  # F16: a float PackedLinear
    write_llama_gguf(tmp_path / "mixed.gguf", source, types=types)
    assert_same_steps(tmp_path / "mixed.gguf", activation_quantization=activations)


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_a_k_quant_files_split_projections_decode_bit_for_bit(tmp_path, activations):
    source = write_tiny_llama(tmp_path / "hf", seed=6, hidden_size=256, intermediate_size=512, head_dim=64)
    types = {f"blk.{i}.{part}.weight": t for i in range(2) for part, t in K_TYPES.items()}
    write_llama_gguf(tmp_path / "q4_k_m.gguf", source, types=types | {"token_embd.weight": "Q6_K"})
    assert_same_steps(tmp_path / "q4_k_m.gguf", activation_quantization=activations)


def test_models_it_does_not_run_keep_the_layer_path(tmp_path):
    llm = LLM(str(build_family("qwen3", tmp_path / "qwen3")), **ENGINE_ARGS)
    llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert llm.engine.model.decode_step is False
    pytorch = LLM("tiny-random", native_cpu_ops="off", **ENGINE_ARGS)
    pytorch.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert pytorch.engine.model.decode_step is None  # no native kernels: never built
