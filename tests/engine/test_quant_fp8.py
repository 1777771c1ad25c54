"""fp8 checkpoints (a ``quantization_config`` in config.json) and ``quantization=fp8``.

The checkpoints are the tiny Llama's weights quantized here to ``torch.float8_e4m3fn`` and written as
llm-compressor (compressed-tensors, per-tensor with static input scales, or per-channel) and DeepSeek-style
block-wise (``quant_method: fp8``, ``weight_block_size``, ``weight_scale_inv``) checkpoints write them, one
projection left in float as an ignored layer would be. Beside each, the test writes the same weights
dequantized (e4m3 value x scale, float32): the model the fp8 checkpoint must compute exactly.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import generate_latest
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.fp8_linear import Fp8Linear, Fp8Weight, dequantize_fp8, quantize_fp8
from kvpilot.engine.model.quantization import resolve_quantization, weights_bytes
from kvpilot.engine.model.tiny import write_tiny_llama
from kvpilot.engine.server.metrics import ServerMetrics
from kvpilot.engine.stats import load_snapshot

ENGINE_ARGS = {"block_size": 4, "num_kv_blocks": 200, "max_num_batched_tokens": 128, "max_num_seqs": 4}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: left in float, as a checkpoint's ignored layers are
FLOAT_KEPT = "model.layers.1.mlp.down_proj.weight"
E4M3_MAX = 448.0
#: block-wise variant: 48 x 40 blocks, so blocks are partial in both dimensions of 64-wide weights
BLOCK = (48, 40)
VARIANTS = {
    "compressed-tensors-tensor": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "ignore": ["lm_head"],
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            }
        },
    },
    "compressed-tensors-channel": {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
    },
    "fp8-block": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(BLOCK),
    },
}


def quantize_blocks(w: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(e4m3, scale [ceil(N/rows), ceil(K/cols)], dequantized float32)``: one scale per block, amax/448."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    deq = torch.empty(n, k)
    scale = torch.empty(-(-n // rows), -(-k // cols))
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            block = w[bi * rows : (bi + 1) * rows, bj * cols : (bj + 1) * cols]
            s = block.abs().max() / E4M3_MAX
            scale[bi, bj] = s
            qb = (block / s).to(torch.float8_e4m3fn)
            q[bi * rows : (bi + 1) * rows, bj * cols : (bj + 1) * cols] = qb
            deq[bi * rows : (bi + 1) * rows, bj * cols : (bj + 1) * cols] = qb.float() * s
    return q, scale, deq


def write_fp8(source: Path, root: Path, variant: str) -> tuple[Path, Path]:
    """The fp8 checkpoint of ``variant`` and its dequantized float twin, both beside ``source``'s files."""
    fp8_dir, deq_dir = root / variant, root / f"{variant}-dequantized"
    for d in (fp8_dir, deq_dir):
        shutil.copytree(source, d)
    tensors = load_file(str(source / "model.safetensors"))
    fp8, deq = {}, {}
    strategy = (
        VARIANTS[variant].get("config_groups", {}).get("group_0", {}).get("weights", {}).get("strategy")
    )
    for name, w in tensors.items():
        if not any(f".{p}.weight" in name for p in PROJECTIONS) or name == FLOAT_KEPT:
            fp8[name] = deq[name] = w
            continue
        prefix = name.removesuffix("weight")
        n, k = w.shape
        if strategy == "tensor":
            q, scale, d = quantize_blocks(w, n, k)
            fp8[prefix + "weight_scale"] = scale.reshape(1)
            fp8[prefix + "input_scale"] = torch.tensor([0.02])
        elif strategy == "channel":
            q, scale, d = quantize_blocks(w, 1, k)
            fp8[prefix + "weight_scale"] = scale  # [N, 1]
        else:
            q, scale, d = quantize_blocks(w, *BLOCK)
            fp8[prefix + "weight_scale_inv"] = scale
        fp8[name], deq[name] = q, d
    save_file(fp8, str(fp8_dir / "model.safetensors"))
    save_file(deq, str(deq_dir / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = VARIANTS[variant]
    (fp8_dir / "config.json").write_text(json.dumps(config))
    return fp8_dir, deq_dir


#: measured on the 81 positions of the float model's greedy sequences (max |logprob diff| of the
#: sequence's own tokens; greedy agreement): 0.246 / 0.877 (tensor), 0.145 / 0.889 (channel), 0.188 / 0.889
#: (48x40 blocks); the random tiny model's distributions are flat, so near-ties flip ~11% of argmaxes
TOLERANCES = {
    "compressed-tensors-tensor": (0.35, 0.85),
    "compressed-tensors-channel": (0.25, 0.85),
    "fp8-block": (0.3, 0.85),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    source = write_tiny_llama(root / "float", seed=11)
    out = {"float": source}
    for variant in VARIANTS:
        out[variant], out[f"{variant}-dequantized"] = write_fp8(source, root, variant)
    return out


_rng = random.Random(5)
PROMPTS = [[_rng.randrange(3, 500) for _ in range(n)] for n in (3, 17, 40)]


def run(model: Path, **kwargs) -> tuple[LLM, list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of ``PROMPTS`` and the log-softmax of every step's logits."""
    return record(LLM(str(model), linear_backend="torch", **ENGINE_ARGS, **kwargs))


def record(llm: LLM) -> tuple[LLM, list[list[int]], list[torch.Tensor]]:
    steps, execute = [], llm.engine.runner.execute

    def recording(batch):
        out = execute(batch)
        steps.append(out.float().log_softmax(-1))
        return out

    llm.engine.runner.execute = recording
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return llm, [o.outputs[0].token_ids for o in outs], steps


def teacher_forced(model: Path, sequences: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
    """Per position of ``sequences`` after the first: the logprob of the sequence's own token, and the
    model's greedy token there (``prompt_logprobs=1``)."""
    llm = LLM(str(model), linear_backend="torch", **ENGINE_ARGS)
    outs = llm.generate(sequences, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1))
    own, greedy = [], []
    for seq, out in zip(sequences, outs, strict=True):
        for token, entry in zip(seq[1:], out.prompt_logprobs[1:], strict=True):
            own.append(entry[token].logprob)
            greedy.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return torch.tensor(own), greedy


@pytest.fixture(scope="module")
def float_run(checkpoints):
    """The float model's greedy sequences (prompt + output) and its teacher-forced logprobs on them."""
    _, tokens, _ = run(checkpoints["float"])
    sequences = [p + t for p, t in zip(PROMPTS, tokens, strict=True)]
    return sequences, teacher_forced(checkpoints["float"], sequences)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fp8_checkpoint_loads_dequantized_on_cpu(checkpoints, float_run, variant, caplog):
    with caplog.at_level(logging.INFO, logger="kvpilot.engine.model"):
        llm, tokens, logprobs = run(checkpoints[variant])
    assert llm.engine.quantization == "none"
    assert "fp8 checkpoint" in caplog.text and "dequantized to torch.float32 at load" in caplog.text
    # exactly the model of its dequantized weights (same float32 values, same ops)
    _, twin_tokens, twin_logprobs = run(checkpoints[f"{variant}-dequantized"])
    assert tokens == twin_tokens
    for ours, twin in zip(logprobs, twin_logprobs, strict=True):
        torch.testing.assert_close(ours, twin, atol=1e-6, rtol=0)
    # and close to the float model (e4m3 keeps 3 mantissa bits), teacher-forced on the float model's greedy
    # sequences so one near-tie (the first prompt's margin is 0.004) does not compare different texts
    sequences, (float_own, float_greedy) = float_run
    own, greedy = teacher_forced(checkpoints[variant], sequences)
    worst = (own - float_own).abs().max().item()
    agree = sum(a == b for a, b in zip(greedy, float_greedy, strict=True)) / len(greedy)
    print(f"{variant}: max |logprob diff| {worst:.4f}, greedy agreement {agree:.3f} of {len(greedy)}")
    assert 1e-4 < worst < TOLERANCES[variant][0], worst
    assert agree >= TOLERANCES[variant][1], agree


def test_cuda_path_keeps_e4m3_layers(checkpoints, monkeypatch):
    """What ``quantization`` resolves to on CUDA, forced here on CPU: the projections hold the checkpoint's
    e4m3 bytes (fused q/k/v and gate/up with their own scales) and compute the dequantized model."""
    _, twin_tokens, twin_logprobs = run(checkpoints["fp8-block-dequantized"])
    monkeypatch.setattr("kvpilot.engine.engine_setup.resolve_quantization", lambda *a, **k: "fp8")
    llm, tokens, logprobs = run(checkpoints["fp8-block"])
    model = llm.engine.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.qweight.dtype == torch.float8_e4m3fn
    assert tuple(qkv.scales.shape) == (64 + 2 * 32, 2)  # q, k, v rows, each with its 40-wide blocks' scales
    assert not isinstance(model.layers[1].mlp.down_proj, Fp8Linear)  # float in the checkpoint
    assert isinstance(model.layers[1].mlp.gate_up_proj, Fp8Linear)
    assert tokens == twin_tokens
    for ours, twin in zip(logprobs, twin_logprobs, strict=True):
        torch.testing.assert_close(ours, twin, atol=1e-5, rtol=0)
    # /load and the model-config info metric say what the weights are kept as
    snap = load_snapshot(llm.engine)
    assert (snap["quantization"], snap["dtype"]) == ("fp8", "float32")
    metrics = ServerMetrics("tiny")
    metrics.attach_gauges(lambda: snap, lambda: "ready")
    exposed = generate_latest(metrics.registry).decode()
    assert 'kvpilot_model_config_info{dtype="float32",model_name="tiny",quantization="fp8"} 1.0' in exposed


def test_fp8_quantizes_a_float_checkpoint_per_row(checkpoints, monkeypatch):
    reference = LLM(str(checkpoints["float"]), linear_backend="torch", **ENGINE_ARGS)
    monkeypatch.setattr("kvpilot.engine.engine_setup.resolve_quantization", lambda *a, **k: "fp8")
    llm, tokens, logprobs = run(checkpoints["float"])
    layers = [m for m in llm.engine.model.layers.modules() if isinstance(m, Fp8Linear)]
    assert len(layers) == 4 * 2 and all(m.scales.shape[1] == 1 for m in layers)
    assert weights_bytes(llm.engine.model) < weights_bytes(reference.engine.model)
    # the float engine with each projection rounded as quantize_fp8 stores it computes the same
    with torch.no_grad():
        for module in reference.engine.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(dequantize_fp8(quantize_fp8(module.weight)))
    _, twin_tokens, twin_logprobs = record(reference)
    assert tokens == twin_tokens
    for ours, twin in zip(logprobs, twin_logprobs, strict=True):
        torch.testing.assert_close(ours, twin, atol=1e-5, rtol=0)


def test_resolution(checkpoints):
    cpu, cuda, fp8_dir = torch.device("cpu"), torch.device("cuda"), checkpoints["fp8-block"]
    assert resolve_quantization("auto", None, cuda, torch.bfloat16, None, fp8_dir) == "fp8"
    assert resolve_quantization("fp8", None, cuda, torch.bfloat16, None, fp8_dir) == "fp8"
    assert resolve_quantization("none", None, cuda, torch.bfloat16, None, fp8_dir) == "none"
    assert resolve_quantization("auto", None, cpu, torch.float32, None, fp8_dir) == "none"
    with pytest.raises(ValueError, match=r"already quantized \(fp8 e4m3 weights with \[48, 40\] block"):
        resolve_quantization("int8", None, cpu, torch.float32, None, fp8_dir)
    with pytest.raises(ValueError, match="quantization='fp8' keeps e4m3 weights on CUDA"):
        resolve_quantization("fp8", None, cpu, torch.float32, None, fp8_dir)
    assert resolve_quantization("fp8", None, cuda, torch.bfloat16, None, checkpoints["float"]) == "fp8"
    assert resolve_quantization("auto", None, cuda, torch.bfloat16, None, checkpoints["float"]) == "none"


@pytest.mark.parametrize(
    ("quantization_config", "named"),
    [
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
            "awq int4, group size 128",
        ),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False},
            "gptq int4, group size 32",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "pack-quantized",
                "config_groups": {"g": {"weights": {"num_bits": 4, "type": "int", "strategy": "group"}}},
            },
            "compressed-tensors pack-quantized with int4 weights",
        ),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quantized as bitsandbytes"),
    ],
)
def test_other_quantized_checkpoints_are_refused_by_name(checkpoints, tmp_path, quantization_config, named):
    model = shutil.copytree(checkpoints["float"], tmp_path / "quantized")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"quantization_config": quantization_config}))
    with pytest.raises(ValueError, match=named) as err:
        LLM(str(model), **ENGINE_ARGS)
    assert "it loads fp8 checkpoints (quant_method 'fp8', or 'compressed-tensors'" in str(err.value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["tensor", "channel", "block", "partial-block"])
def test_fp8_linear_matches_its_reference(dtype, layout):
    gen = torch.Generator().manual_seed(3)
    n, k = 48, 96
    w = torch.randn(n, k, generator=gen) * 0.05
    bk = {"tensor": k, "channel": k, "block": 32, "partial-block": 40}[layout]
    groups = -(-k // bk)
    data = (w * 200).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(n, groups, generator=gen) + 0.5
    if layout == "tensor":
        scales = scales[:1].expand(n, 1).contiguous()
    layer = Fp8Linear(Fp8Weight(data, scales, bk), True, dtype)
    layer.bias.copy_(torch.randn(n, generator=gen))
    x = torch.randn(5, k, generator=gen).to(dtype)
    # reference: every weight times its own scale, element by element
    ref_w = torch.empty(n, k)
    for col in range(k):
        ref_w[:, col] = data[:, col].float() * scales[:, col // bk]
    expected = F.linear(x.float(), ref_w.to(dtype).float(), layer.bias.float())
    torch.testing.assert_close(
        layer(x).float(), expected, atol=1e-4 if dtype == torch.float32 else 0.1, rtol=2e-2
    )
    torch.testing.assert_close(dequantize_fp8(layer.weight_fp8), ref_w, atol=0, rtol=0)


def test_quantize_fp8_rounds_each_row_to_its_own_scale():
    w = torch.tensor([[0.5, -1.75, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [448.0, 1.0, -2.0, 3.0]])
    q = quantize_fp8(w)
    assert q.scales.flatten().tolist() == [1.0 / 256, 1.0, 1.0]
    torch.testing.assert_close(dequantize_fp8(q), w, atol=0, rtol=0)  # each value is e4m3 x its scale
