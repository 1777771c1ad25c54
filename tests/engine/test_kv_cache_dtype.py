"""``kv_cache_dtype`` auto / fp8 / int8 through the engine (docs/architecture.md#kv-cache-dtype): the
argument and flag, the blocks a budget holds, the cache's scales moving with its blocks (copy-on-write and
host swap), checkpoint k/v scales, and greedy decoding on the tiny model: the C kernels, the PyTorch ops and
the Triton kernels (interpreter) produce the same tokens from the same codes, with prefix caching,
chunked prefill, preemption (recompute or swap) and speculative decoding changing nothing and leaking no
block; and (slow) the issue's perplexity gate on SmolLM2."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
from engine_runs import run_checked
from safetensors.torch import load_file, save_file

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.arg_utils import add_engine_args, engine_args_from_namespace
from kvpilot.engine.config import ConfigError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache
from kvpilot.engine.kv.kv_quant import KVQuant
from kvpilot.engine.model.tiny import write_tiny_llama
from kvpilot.engine.stats import load_snapshot

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _prompts(seed: int, count: int, lo: int, hi: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(lo, hi))] for _ in range(count)]


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_kv_cache_dtype_argument_flag_and_errors():
    assert EngineArgs(kv_cache_dtype="int8").create_config().cache.kv_cache_dtype == "int8"
    assert EngineArgs().create_config().cache.kv_cache_dtype == "auto"
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    ns = parser.parse_args(["--kv-cache-dtype", "fp8"])
    assert engine_args_from_namespace(ns).create_config().cache.kv_cache_dtype == "fp8"
    with pytest.raises(
        ConfigError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'int8'\), got 'fp16'"
    ):
        EngineArgs(kv_cache_dtype="fp16").create_config()
    with pytest.raises(ConfigError, match="fp8 KV cache is e4m3"):
        EngineArgs(kv_cache_dtype="fp8_e5m2").create_config()


# tiny-random: 2 layers x 2 KV heads x head_dim 16; per token K+V: fp32 2*2*2*16*4 = 512 bytes; fp8 and
# int8 128 + 2*2*2*4 (a float32 scale per layer, head, K and V) = 160 (fp8 with checkpoint scales: 128,
# test_checkpoint_kv_scales_are_the_fp8_scales)
@pytest.mark.parametrize(
    ("kv_cache_dtype", "per_token", "blocks"), [("auto", 512, 122), ("fp8", 160, 390), ("int8", 160, 390)]
)
def test_blocks_for_a_budget_grow_with_the_smaller_element(tiny_model_dir, kv_cache_dtype, per_token, blocks):
    llm = LLM(
        "tiny-random",
        device="cpu",
        dtype="float32",
        kv_cache_memory_bytes=1_000_000,
        kv_cache_dtype=kv_cache_dtype,
    )
    engine = llm.engine
    assert blocks == 1_000_000 // (per_token * 16)
    assert (engine.kv_bytes_per_token, engine.kv_cache.num_blocks) == (per_token, blocks)
    snap = load_snapshot(engine)
    assert (snap["kv_cache_dtype"], snap["kv_blocks_total"], snap["kv_cache_bytes"]) == (
        kv_cache_dtype,
        blocks - 1,
        blocks * 16 * per_token,
    )
    assert engine.kv_cache.total_bytes == sum(
        t.numel() * t.element_size()
        for layer in engine.kv_cache.layers
        for t in (
            layer.key,
            layer.value,
            layer.quant and layer.quant.key_scales,
            layer.quant and layer.quant.value_scales,
        )
        if t is not None
    )


def test_metrics_report_the_cache_dtype_and_its_blocks(tiny_model_dir):
    from prometheus_client import generate_latest

    from kvpilot.engine.server.metrics import ServerMetrics

    llm = LLM(
        "tiny-random", device="cpu", dtype="float32", kv_cache_memory_bytes=1_000_000, kv_cache_dtype="fp8"
    )
    metrics = ServerMetrics("tiny-random")
    metrics.attach_gauges(lambda: load_snapshot(llm.engine), lambda: "ready")
    text = generate_latest(metrics.registry).decode()
    assert (
        'kvpilot_cache_config_info{block_size="16",cache_dtype="fp8",kv_cache_sizing="kv_cache_memory_bytes",'
        'model_name="tiny-random",num_gpu_blocks="389"} 1.0' in text
    )
    assert 'kvpilot_kv_cache_blocks{model_name="tiny-random",state="total"} 389.0' in text


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_block_copies_and_swaps_move_codes_and_scales(kv_cache_dtype):
    cache = KVCache(2, 6, 4, 2, 16, torch.float32, torch.device("cpu"), "HND", kv_cache_dtype)
    g = torch.Generator().manual_seed(0)
    for layer in cache.layers:
        layer.key.view(torch.uint8).copy_(
            torch.randint(0, 120, layer.key.shape, generator=g, dtype=torch.uint8)
        )
        layer.value.view(torch.uint8).copy_(
            torch.randint(0, 120, layer.value.shape, generator=g, dtype=torch.uint8)
        )
        if layer.quant.key_scales is not None:
            layer.quant.key_scales.copy_(torch.rand(layer.quant.key_scales.shape, generator=g))
            layer.quant.value_scales.copy_(torch.rand(layer.quant.value_scales.shape, generator=g))

    def block(i):
        out = []
        for layer in cache.layers:
            out += [layer.key[i].view(torch.uint8).clone(), layer.value[i].view(torch.uint8).clone()]
            if layer.quant.key_scales is not None:
                out += [layer.quant.key_scales[i].clone(), layer.quant.value_scales[i].clone()]
        return out

    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    two, three = block(2), block(3)
    assert not same(two, three)
    cache.copy_blocks([2], [5])
    assert same(block(5), two)
    swap = HostSwapSpace(cache, 3)
    host = swap.swap_out([3])
    for layer in cache.layers:  # the device block is reused meanwhile
        layer.key[3].view(torch.uint8).zero_()
        if layer.quant.key_scales is not None:
            layer.quant.key_scales[3].zero_()
    swap.swap_in(host, [1])
    assert same(block(1), three)
    assert swap.num_free == 3


def test_checkpoint_kv_scales_are_the_fp8_scales(tmp_path):
    model_dir = write_tiny_llama(tmp_path / "m", seed=0)
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)  # the older single scale
    save_file(tensors, model_dir / "model.safetensors")
    prompts = _prompts(4, 3, 5, 20)
    llm = LLM(
        str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4, kv_cache_dtype="fp8"
    )
    assert [(layer.quant.k_scale, layer.quant.v_scale) for layer in llm.engine.kv_cache.layers] == [
        (0.5, 0.25),
        (2.0, 2.0),
    ]
    assert all(layer.quant.key_scales is None for layer in llm.engine.kv_cache.layers)  # no row scales
    assert llm.engine.kv_bytes_per_token == 128
    assert all(len(t) == 12 for t in _tokens(run_checked(llm, prompts, GREEDY)))
    # the float cache ignores them (and the weight loader does not count them as unknown weights)
    LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    del tensors["model.layers.1.self_attn.kv_scale"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ValueError, match="none for layer 1"):
        LLM(
            str(model_dir),
            device="cpu",
            dtype="float32",
            num_kv_blocks=64,
            block_size=4,
            kv_cache_dtype="fp8",
        )


def _llm(kv_cache_dtype: str, **kwargs) -> LLM:
    base = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 256, "block_size": 4}
    return LLM("tiny-random", kv_cache_dtype=kv_cache_dtype, **{**base, **kwargs})


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir):
    """Greedy tokens of plain batches (no prefix caching), per KV dtype, on the C kernels."""
    prompts = _prompts(3, 8, 10, 40)
    return prompts, {
        kv: _tokens(run_checked(_llm(kv, enable_prefix_caching=False), prompts, GREEDY))
        for kv in ("auto", "fp8", "int8")
    }


def _agreement(reference: list[list[int]], candidate: list[list[int]]) -> float:
    """Share of reference tokens before each sequence's first divergence."""
    agree = 0
    for a, b in zip(reference, candidate, strict=True):
        agree += next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
    return agree / sum(len(a) for a in reference)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_pytorch_ops_read_the_codes_as_the_c_kernels_do(reference_tokens, kv_cache_dtype):
    prompts, tokens = reference_tokens
    plain = _tokens(
        run_checked(_llm(kv_cache_dtype, native_cpu_ops="off", enable_prefix_caching=False), prompts, GREEDY)
    )
    assert plain == tokens[kv_cache_dtype]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_prefix_caching_chunked_prefill_and_preemption_keep_the_tokens(reference_tokens, kv_cache_dtype):
    prompts, tokens = reference_tokens
    shared = [prompts[0][:16] + p for p in prompts[:4]]  # a 4-block common prefix
    alone = _tokens(run_checked(_llm(kv_cache_dtype, enable_prefix_caching=False), shared, GREEDY))
    llm = _llm(kv_cache_dtype, enable_prefix_caching=True, max_num_batched_tokens=24, max_num_seqs=4)
    first = _tokens(run_checked(llm, shared[:1], GREEDY))
    assert first + _tokens(run_checked(llm, shared[1:], GREEDY)) == alone
    assert llm.engine.stats.prefix_cache_hits == 3 * 16  # each later prompt reused the 4 cached blocks
    for mode, extra in (("recompute", {}), ("swap", {"swap_space": 0.01})):
        small = _llm(
            kv_cache_dtype,
            num_kv_blocks=24,
            max_num_seqs=6,
            preemption_mode=mode,
            enable_prefix_caching=False,
            **extra,
        )
        assert _tokens(run_checked(small, prompts, GREEDY)) == tokens[kv_cache_dtype], mode
        assert small.engine.scheduler.num_preemptions > 0
        if mode == "swap":
            assert small.engine.kv.swap.num_free == small.engine.kv.swap.num_blocks  # all host blocks back


def test_low_precision_kv_agreement_with_the_float_cache(reference_tokens):
    """Measured on this tiny random model (whose top logits are close: many near-ties), the share of the
    96 greedy tokens before each prompt's first divergence from the float cache: fp8 0.86, int8 1.0. The
    bounds hold them; the negative control (fp8 read with per-tensor scales, K's 1e-4: every key code
    saturates at 448 and attention goes uniform) falls far below."""
    prompts, tokens = reference_tokens
    assert _agreement(tokens["auto"], tokens["fp8"]) >= 0.75
    assert _agreement(tokens["auto"], tokens["int8"]) >= 0.9
    broken = _llm("fp8", enable_prefix_caching=False)
    layers = broken.engine.kv_cache.layers
    layers[:] = [layer._replace(quant=KVQuant("fp8", k_scale=1e-4, v_scale=1.0)) for layer in layers]
    assert _agreement(tokens["auto"], _tokens(run_checked(broken, prompts, GREEDY))) < 0.3


@pytest.mark.triton
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_triton_kernels_read_the_codes_as_the_c_kernels_do(reference_tokens, kv_cache_dtype):
    prompts, tokens = reference_tokens
    few = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    triton = _tokens(
        run_checked(
            _llm(kv_cache_dtype, attention_backend="triton", enable_prefix_caching=False), prompts[:3], few
        )
    )
    assert triton == [t[:6] for t in tokens[kv_cache_dtype][:3]]


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_speculative_decoding_over_a_quantized_cache_keeps_the_tokens(tiny_model_dir, kv_cache_dtype):
    """ngram and a same-weights draft model (its own cache in the same format) verify drafts against codes:
    greedy tokens equal the plain engine's over the same cache dtype."""
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 500) for _ in range(8)] * 4 for _ in range(4)]  # repetitive: ngram drafts
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    want = _tokens(run_checked(_llm(kv_cache_dtype), prompts, params))
    spec = {"num_speculative_tokens": 3, "disable_by_batch_size": 64}
    for config in (
        {"method": "ngram", **spec},
        {"method": "draft_model", "model": str(tiny_model_dir), **spec},
    ):
        llm = _llm(kv_cache_dtype, speculative_config=config)
        assert _tokens(run_checked(llm, prompts, params)) == want, config["method"]
        assert llm.engine.stats.spec_accepted_tokens > 0
        if config["method"] == "draft_model":
            draft = llm.engine.draft_model.cache
            assert draft.kv_cache_dtype == kv_cache_dtype and draft.layers[0].quant.key_scales is not None


@pytest.mark.slow
def test_smollm2_perplexity_gate_and_what_per_tensor_scales_miss(smollm2_dir):
    """The issue's gate on the real model (bench/quantization.py's fixed text): fp8 and int8 KV change
    perplexity by at most 1% (measured +0.45% and +0.57%); the negative control, fp8 with vLLM's default
    per-tensor scales of 1.0, misses it (+1.40%: first-layer V lives in e4m3's subnormals)."""
    from bench_scripts import bench_script

    bench = bench_script("quantization")

    def ppl(kv: str, per_tensor: bool = False) -> float:
        llm = LLM(str(smollm2_dir), kv_cache_dtype=kv, kv_cache_memory_bytes=64 << 20)
        if per_tensor:
            layers = llm.engine.kv_cache.layers
            layers[:] = [layer._replace(quant=KVQuant("fp8", k_scale=1.0, v_scale=1.0)) for layer in layers]
        return bench.perplexity(llm, bench.PERPLEXITY_TEXT)

    base = ppl("auto")
    for kv in ("fp8", "int8"):
        assert abs(ppl(kv) / base - 1) <= 0.01, kv
    assert ppl("fp8", per_tensor=True) / base - 1 > 0.01
