"""The engine on quantized weights (``quantization``): a GGUF keeps its blocks by default, int8 quantizes a
float model at load, and both compute what the float path computes on the same (dequantized) weights.

The GGUF is a tiny llama written with llama.cpp's permutation and gguf's quantizer, its tensors in every
runnable format (Q4_0 q/k/v, Q4_1 output and down projections, Q8_0 gate/up and the tied embedding) and
one in F16, which has no kernel and must stay float, with the log saying so.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import pytest
import torch
from cpu_features import HAS_INT8_KERNEL, NO_INT8_KERNEL
from engine_runs import record_step_logits
from gguf import GGMLQuantizationType
from gguf.quants import quantize as gguf_quantize
from quantized_ggufs import write_k_quant_gguf, write_mixed_gguf

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.arg_utils import add_engine_args, config_from_namespace
from kvpilot.engine.config import ConfigError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.model.quant_formats import QuantWeight, dequantize, quantize_int8
from kvpilot.engine.model.quant_linear import (
    QUANT_NATIVE_MAX_ROWS,
    QuantEmbedding,
    QuantLinear,
    SplitQuantLinear,
)
from kvpilot.engine.model.quantization import (
    resolve_activation_quantization,
    resolve_quantization,
    weights_bytes,
)
from kvpilot.engine.native.quant_ops import FORMATS

ENGINE_ARGS = {"block_size": 4, "num_kv_blocks": 400, "max_num_batched_tokens": 320, "max_num_seqs": 6}
# float32 activations: these tests hold the quantized GEMMs to the float path's exact products (int8
# activations, the default on AVX2 / AVX-512 VNNI CPUs, have their own tests below)
ENGINE_ARGS |= {"activation_quantization": "none"}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_mixed_gguf(tmp_path_factory.mktemp("quantized"))


def prompts() -> list[list[int]]:
    rng = random.Random(8)
    # one prompt longer than the kernel's row limit: its prefill takes the dequantize-and-GEMM path
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (1, 9, 30, QUANT_NATIVE_MAX_ROWS + 40)]


def run(model: str, **kwargs):
    return run_engine(LLM(model, **ENGINE_ARGS, **kwargs))


def run_engine(llm: LLM):
    """Greedy outputs of ``prompts()`` and the logits of every step."""
    logits = record_step_logits(llm)
    outs = llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs], logits


def test_gguf_keeps_its_blocks_and_computes_the_float_path(tiny_gguf, caplog):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.model"):
        quant, quant_tokens, quant_logits = run(str(tiny_gguf))  # auto: the GGUF's blocks
    float_llm, float_tokens, float_logits = run(str(tiny_gguf), quantization="none")
    model = quant.engine.model
    assert quant.engine.quantization == "gguf" and float_llm.engine.quantization == "none"
    attn = model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and attn.qkv_proj.format == "Q4_0"
    assert attn.o_proj.format == "Q4_1" and model.layers[0].mlp.gate_up_proj.format == "Q8_0"
    assert isinstance(model.layers[1].mlp.down_proj, torch.nn.Module)
    assert not isinstance(model.layers[1].mlp.down_proj, QuantLinear)  # F16: no kernel, kept float
    assert "kept in float: layers.1.mlp.down_proj (F16)" in caplog.text
    assert isinstance(model.embed_tokens, QuantEmbedding) and isinstance(model.packed_lm_head, QuantLinear)
    assert model.packed_lm_head.qweight is model.embed_tokens.qweight  # the tied head shares the blocks
    assert weights_bytes(model) < weights_bytes(float_llm.engine.model) / 2
    assert "weights: " in caplog.text and "quantization gguf" in caplog.text
    assert quant.engine.model_identity != float_llm.engine.model_identity  # distinct prefix-cache chains
    assert quant_tokens == float_tokens
    for ours, reference in zip(quant_logits, float_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_gguf_without_native_kernels_computes_the_same(tiny_gguf, caplog):
    _, native_tokens, native_logits = run(str(tiny_gguf), quantization="gguf")
    with caplog.at_level(logging.WARNING):
        llm, tokens, logits = run(str(tiny_gguf), quantization="gguf", native_cpu_ops="off")
    assert llm.engine.native_ops is None and "without the native C kernels" in caplog.text
    assert tokens == native_tokens
    for ours, reference in zip(logits, native_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_int8_quantizes_a_float_model_at_load(tiny_model_dir):
    quant, quant_tokens, quant_logits = run(str(tiny_model_dir), quantization="int8")
    float_llm = LLM(str(tiny_model_dir), linear_backend="torch", **ENGINE_ARGS)
    model, reference = quant.engine.model, float_llm.engine.model
    assert float_llm.engine.quantization == "none"  # auto: a float checkpoint stays float
    assert all(
        isinstance(m, QuantLinear) and m.format == "int8"
        for layer in model.layers
        for m in (
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        )
    )
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.packed_lm_head.format == "int8"
    assert weights_bytes(model) < weights_bytes(reference) / 2
    # the float engine with every weight rounded as int8 stores it computes the same, up to summation order
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                module.weight.copy_(dequantize(quantize_int8(module.weight)))
    _, tokens, logits = run_engine(float_llm)
    assert quant_tokens == tokens
    for ours, expected in zip(quant_logits, logits, strict=True):
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_quantization_is_validated_at_the_boundary(tiny_gguf, tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"quantization must be one of \('auto', 'none', 'gguf', 'int8', 'fp8'\)"
    ):
        EngineArgs(quantization="q4").create_config()
    with pytest.raises(ConfigError, match="quantization='fp8' needs a CUDA device"):
        EngineArgs(quantization="fp8", device="cpu").create_config()
    with pytest.raises(ConfigError, match=r"'awq' is not available .* choices"):
        EngineArgs(quantization="awq").create_config()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        config_from_namespace(parser, parser.parse_args(["--quantization", "fp8", "--device", "cpu"]))
    assert config_from_namespace(parser, parser.parse_args(["-q", "int8"])).model.quantization == "int8"
    with pytest.raises(ValueError, match="quantization='gguf' needs a GGUF model"):
        LLM(str(tiny_model_dir), quantization="gguf")
    with pytest.raises(ValueError, match="runs float32 activations on CPU"):
        LLM(str(tiny_gguf), quantization="gguf", dtype="bfloat16")


def test_auto_dequantizes_where_the_kernels_cannot_run(caplog):
    cpu, path = torch.device("cpu"), Path("model.gguf")
    with caplog.at_level(logging.INFO):
        assert resolve_quantization("auto", path, cpu, torch.bfloat16, native=object()) == "none"
        assert resolve_quantization("auto", path, cpu, torch.float32, native=None) == "none"
    assert "run float32 on CPU, not torch.bfloat16" in caplog.text
    assert "the C kernels could not be built" in caplog.text
    assert resolve_quantization("auto", None, cpu, torch.float32, native=object()) == "none"
    assert resolve_quantization("auto", path, cpu, torch.float32, native=object()) == "gguf"
    assert resolve_quantization("none", path, cpu, torch.float32, native=object()) == "none"
    with pytest.raises(ValueError, match=r"got torch\.float32 on cuda"):
        resolve_quantization("int8", None, torch.device("cuda"), torch.float32, native=None)


@pytest.fixture(scope="module")
def k_quant_gguf(tmp_path_factory) -> Path:
    return write_k_quant_gguf(tmp_path_factory.mktemp("k-quants"))


def test_k_quants_keep_their_super_blocks_and_compute_the_float_path(k_quant_gguf):
    quant, quant_tokens, quant_logits = run(str(k_quant_gguf))
    float_llm, float_tokens, float_logits = run(str(k_quant_gguf), quantization="none")
    model = quant.engine.model
    assert quant.engine.quantization == "gguf"
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    # Q4_K q/k with a Q6_K v: the fused projection keeps each part in its own format
    assert isinstance(attn.qkv_proj, SplitQuantLinear) and attn.qkv_proj.formats == ["Q4_K", "Q4_K", "Q6_K"]
    assert isinstance(mlp.gate_up_proj, QuantLinear) and mlp.gate_up_proj.format == "Q4_K"
    assert isinstance(mlp.down_proj, QuantLinear) and mlp.down_proj.format == "Q6_K"
    assert isinstance(attn.o_proj, QuantLinear) and attn.o_proj.format == "Q4_K"
    assert isinstance(model.embed_tokens, QuantEmbedding) and model.packed_lm_head.format == "Q6_K"
    assert weights_bytes(model) < weights_bytes(float_llm.engine.model) / 4
    assert quant_tokens == float_tokens
    for ours, reference in zip(quant_logits, float_logits, strict=True):
        torch.testing.assert_close(ours, reference, atol=1e-4, rtol=1e-4)


def test_split_projection_is_its_parts_side_by_side_plus_the_bias():
    """Each part in its own format (here Q4_0 and Q8_0 rows over the same inputs), the fused bias added
    once over all of them; parts with other input widths are refused."""
    g = torch.Generator().manual_seed(3)
    dense = [torch.randn(n, 64, generator=g) / 8 for n in (24, 8)]
    parts = [
        QuantWeight(FORMATS[f], torch.from_numpy(gguf_quantize(w.numpy(), GGMLQuantizationType[f])), None, 64)
        for f, w in zip(("Q4_0", "Q8_0"), dense, strict=True)
    ]
    layer = SplitQuantLinear(parts, has_bias=True, native=None)
    layer.bias.copy_(torch.arange(32, dtype=torch.float32))
    x = torch.randn(3, 64, generator=g)
    expected = torch.cat([x @ dequantize(p).T for p in parts], dim=-1) + layer.bias
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)
    assert layer.formats == ["Q4_0", "Q8_0"] and layer.out_features == 32
    with pytest.raises(ValueError, match="share their inputs"):
        SplitQuantLinear([parts[0], quantize_int8(torch.randn(4, 32))], has_bias=False, native=None)


@pytest.mark.skipif(not HAS_INT8_KERNEL, reason=NO_INT8_KERNEL)
def test_int8_activations_run_every_packable_layer_close_to_the_float_path(tiny_gguf):
    """``activation_quantization='int8'``: the packable layers (Q4_0 / Q4_1 / Q8_0 and the tied Q8_0 head;
    not the F16 tensor) run the int8-activation GEMM, whose rounding moves the logits a little, never
    much; the model identity says so (another prefix-cache chain)."""
    args = ENGINE_ARGS | {"activation_quantization": "int8"}
    quant, _, quant_logits = run_engine(LLM(str(tiny_gguf), **args))
    exact, _, exact_logits = run(str(tiny_gguf))
    model = quant.engine.model
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 8 and all(m.vnni_weight is not None for m in layers)  # 7 projections + the head
    assert "cpu-int8-activations" in repr(model.packed_lm_head)
    assert all(m.vnni_weight is None for m in exact.engine.model.modules() if isinstance(m, QuantLinear))
    # the decoder projections hold only their packed tiles; the tied head's blocks stay the embedding's
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.qweight.numel() == 0 and attn.o_proj.qweight.numel() == 0
    assert model.packed_lm_head.qweight is model.embed_tokens.qweight and model.embed_tokens.qweight.numel()
    with pytest.raises(ValueError, match="released once repacked"):
        attn.qkv_proj.weight_q  # noqa: B018 - the property refuses
    # tiles (fp16 d and m per 32 weights) are about the stored blocks' bytes; the head's tiles come on top
    exact_bytes = weights_bytes(exact.engine.model)
    assert exact_bytes < weights_bytes(model) < 1.5 * exact_bytes
    assert quant.engine.model_identity == exact.engine.model_identity + "+aint8"
    worst = max(
        float((a - b).abs().max() / b.abs().max()) for a, b in zip(quant_logits, exact_logits, strict=True)
    )
    assert 1e-5 < worst < 0.05, worst


def test_activation_quantization_is_validated(tiny_gguf, tiny_model_dir):
    with pytest.raises(
        ConfigError, match=r"activation_quantization must be one of \('auto', 'none', 'int8', 'fp8'\)"
    ):
        EngineArgs(activation_quantization="int4").create_config()
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--activation-quantization", "none"])
    assert config_from_namespace(parser, ns).model.activation_quantization == "none"
    with pytest.raises(ValueError, match="applies to quantization 'gguf' or 'int8'"):
        LLM(str(tiny_model_dir), **ENGINE_ARGS | {"activation_quantization": "int8"})
    with pytest.raises(ValueError, match="native C kernels are off"):
        LLM(
            str(tiny_gguf),
            quantization="gguf",
            native_cpu_ops="off",
            **ENGINE_ARGS | {"activation_quantization": "int8"},
        )


def test_auto_activations_are_int8_only_where_the_vnni_kernel_runs():
    cpu = torch.device("cpu")

    class Native:
        class vnni:
            available = True

    assert resolve_activation_quantization("auto", "gguf", cpu, Native(), "onednn") == "int8"
    assert resolve_activation_quantization("auto", "int8", cpu, Native(), "torch") == "int8"
    assert resolve_activation_quantization("none", "gguf", cpu, Native(), "onednn") == "none"
    assert resolve_activation_quantization("auto", "none", cpu, Native(), "onednn") == "none"
    assert resolve_activation_quantization("auto", "gguf", cpu, Native(), "triton") == "none"
    assert resolve_activation_quantization("auto", "gguf", torch.device("cuda"), Native(), "torch") == "none"
    assert resolve_activation_quantization("auto", "gguf", cpu, None, "onednn") == "none"
    cuda = torch.device("cuda")
    assert resolve_activation_quantization("auto", "fp8", cuda, None, "triton") == "none"  # W8A8 is opt-in
    assert resolve_activation_quantization("fp8", "fp8", cuda, None, "triton") == "fp8"
    with pytest.raises(ValueError, match="runs fp8 weights on the Triton GEMM"):
        resolve_activation_quantization("fp8", "fp8", cuda, None, "torch")
    with pytest.raises(ValueError, match="fp8 weights take 'fp8'"):
        resolve_activation_quantization("int8", "fp8", cuda, None, "triton")
    Native.vnni.available = False
    assert resolve_activation_quantization("auto", "gguf", cpu, Native(), "onednn") == "none"
    with pytest.raises(ValueError, match="has no int8-activation kernel"):
        resolve_activation_quantization("int8", "gguf", cpu, Native(), "onednn")
