"""Every dense family against HF transformers' own implementation (docs/models.md).

Each family's tiny model is built and saved by the installed transformers (``hf_families``), loaded by
kvpilot's ``LLM`` with prefix caching and chunked prefill on (a 16-token step budget, 4-token blocks), and
must give HF eager's greedy tokens for 32 steps and each token's logprob within 1e-4, for greedy and for
seeded sampled requests (HF scores the sampled tokens one at a time with its KV cache). The wave runs
a prompt longer than the budget (chunked), a short one, a sampled one, then a prompt sharing 16 tokens of
the first (a prefix-cache hit, then an extend). Backends: the torch backend with the fused C kernels (the
CPU default), without them (PyTorch ops, incl. the unfused soft-capped attention) and the Triton kernels
in the interpreter (slow). Negative controls show each family's distinguishing feature changes HF's
outputs by far more than the tolerance, so a loader ignoring it would fail.
"""

from triton_device import DEVICE  # isort: skip  (sets TRITON_INTERPRET=1 on CPU before the kernels load)

import json
from pathlib import Path

import pytest
from hf_families import FAMILIES, build_family, hf_reference, load_hf
from transformers import AutoTokenizer

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.prompt_render import chat_prompt_ids
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.server import load_profiler

STEPS = 32
LONG = [(7 * i + 3) % 300 + 5 for i in range(20)]  # > the 16-token budget: prefilled in two chunks
SHORT = [(5 * i + 1) % 250 + 20 for i in range(7)]
SAMPLED = [(3 * i + 11) % 280 + 9 for i in range(9)]
SHARED = [*LONG[:16], 9, 8, 7]  # its first four blocks are the first wave's cached LONG blocks
ENGINE_ARGS = {
    "dtype": "float32",
    "block_size": 4,
    "num_kv_blocks": 160,
    "max_num_batched_tokens": 16,
    "max_num_seqs": 4,
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
}
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, logprobs=0)
SAMPLE = SamplingParams(temperature=1.0, seed=1234, max_tokens=STEPS, ignore_eos=True, logprobs=0)
#: per family, overrides that switch its distinguishing feature off (the negative controls)
CONTROLS = {
    "llama3": {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}},
    "qwen3": {"use_sliding_window": False},
    "phi3": {"rope_parameters": {**FAMILIES["phi3"][2]["rope_parameters"], "long_factor": [1.0] * 8}},
    "phi3-partial": {
        "rope_parameters": {**FAMILIES["phi3"][2]["rope_parameters"], "partial_rotary_factor": 1.0},
        "original_max_position_embeddings": 24,
    },
    "gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None},
    "gemma3": {
        "rope_parameters": {
            "sliding_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
        }
    },
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, tuple[Path, dict]]:
    """Each family's directory and HF's results: greedy (tokens, logprobs) per prompt, and the logprobs
    HF gives the sampled tokens (filled in by the first test that samples them)."""
    root = tmp_path_factory.mktemp("families")
    built = {}
    for name in FAMILIES:
        directory = build_family(name, root / name)
        hf = load_hf(directory)
        greedy = {tuple(p): hf_reference(hf, p, STEPS) for p in (LONG, SHORT, SHARED)}
        built[name] = (directory, {"hf": hf, "greedy": greedy})
    return built


def run_wave(directory: Path, **engine_args) -> tuple[list, object, int]:
    llm = LLM(str(directory), **ENGINE_ARGS, **engine_args)
    first = llm.generate([LONG, SHORT], GREEDY)
    sampled = llm.generate([SAMPLED], SAMPLE)[0]
    second = llm.generate([SHARED], GREEDY)[0]
    return [*first, second], sampled, second.num_cached_tokens


def check_family(models, name: str, **engine_args) -> None:
    directory, reference = models[name]
    greedy, sampled, cached = run_wave(directory, **engine_args)
    assert cached == 16  # the prefix-cache hit really happened
    for prompt, out in zip((LONG, SHORT, SHARED), greedy, strict=True):
        tokens, logprobs = reference["greedy"][tuple(prompt)]
        completion = out.outputs[0]
        assert completion.token_ids == tokens, (name, prompt[:3])
        ours = [step[t].logprob for t, step in zip(completion.token_ids, completion.logprobs, strict=True)]
        assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 1e-4
    completion = sampled.outputs[0]
    drawn = completion.token_ids
    _, hf_logprobs = hf_reference(reference["hf"], SAMPLED, STEPS, choose=lambda step, _: drawn[step])
    ours = [step[t].logprob for t, step in zip(drawn, completion.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in zip(ours, hf_logprobs, strict=True)) < 1e-4
    assert len(set(drawn)) > 8  # really sampled, not a greedy run


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_hf_on_the_native_cpu_path(models, name: str) -> None:
    check_family(models, name, attention_backend="torch", native_cpu_ops="on")


# the default run keeps the families whose PyTorch path differs (soft-capped attention unfused, q/k norm,
# per-layer RoPE, partial rotary); Llama 3 and Phi-3 only rotate differently, which the native run covers
PYTORCH_DEFAULT = ("gemma2", "gemma3", "qwen3", "phi3-partial")


@pytest.mark.parametrize(
    "name",
    [n if n in PYTORCH_DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in sorted(FAMILIES)],
)
def test_family_matches_hf_with_pytorch_ops(models, name: str) -> None:
    check_family(models, name, attention_backend="torch", native_cpu_ops="off")


@pytest.mark.slow
@pytest.mark.triton
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_hf_on_the_triton_backend(models, name: str) -> None:
    check_family(models, name, attention_backend="triton", device=DEVICE.type)


@pytest.mark.parametrize("name", sorted(CONTROLS))
def test_each_familys_feature_changes_hf_outputs(models, tmp_path: Path, name: str) -> None:
    control = load_hf(build_family(name, tmp_path / name, **CONTROLS[name]))
    _, logprobs = models[name][1]["greedy"][tuple(LONG)]
    _, control_logprobs = hf_reference(control, LONG, STEPS)
    assert max(abs(a - b) for a, b in zip(logprobs, control_logprobs, strict=True)) > 1e-3


def test_arch_reads_each_familys_features(models) -> None:
    arch = {name: ModelArchConfig.from_dir(directory) for name, (directory, _) in models.items()}
    assert arch["qwen3"].qk_norm and arch["qwen3"].layer_windows == (None, 8)
    assert arch["phi3"].fused_checkpoint and arch["phi3"].rope_scaling["rope_type"] == "longrope"
    assert arch["phi3"].layer_windows == (24,) * 2 and arch["phi3"].sliding_window == 24
    assert (arch["phi3"].rotary_dim, arch["phi3-partial"].rotary_dim) == (16, 12)
    gemma2 = arch["gemma2"]
    assert (gemma2.layer_windows, gemma2.sliding_window) == ((8, None), None)
    assert (gemma2.attn_logit_softcap, gemma2.final_logit_softcap, gemma2.attention_scale) == (
        2.0,
        3.0,
        24**-0.5,
    )
    assert gemma2.hidden_act == "gelu_pytorch_tanh" and gemma2.gemma_norms
    gemma3 = arch["gemma3"]
    assert gemma3.layer_windows == (8, 8, None) and gemma3.qk_norm and gemma3.attn_logit_softcap is None
    assert gemma3.local_rope == (10000.0, None)
    assert (gemma3.rope_theta, gemma3.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 4.0})


def test_legacy_config_forms_read_as_the_v5_ones(models) -> None:
    """Llama 3.x with ``rope_theta`` + ``rope_scaling`` and Gemma 3 with ``rope_local_base_freq`` (configs
    written by transformers < 5) give the architecture their ``rope_parameters`` forms give."""
    llama = json.loads((models["llama3"][0] / "config.json").read_text())
    params = llama.pop("rope_parameters")
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    legacy = {**llama, "rope_theta": params["rope_theta"], "rope_scaling": scaling}
    assert ModelArchConfig.from_dict(legacy) == ModelArchConfig.from_dict(
        {**llama, "rope_parameters": params}
    )
    gemma = json.loads((models["gemma3"][0] / "config.json").read_text())
    nested = gemma.pop("rope_parameters")
    old = {
        **gemma,
        "rope_theta": nested["full_attention"]["rope_theta"],
        "rope_local_base_freq": nested["sliding_attention"]["rope_theta"],
        "rope_scaling": {"rope_type": "linear", "factor": 4.0},
    }
    assert ModelArchConfig.from_dict(old) == ModelArchConfig.from_dict({**gemma, "rope_parameters": nested})


def test_chat_templates_render_as_hf_in_engine_and_router(models) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi!"},
        {"role": "user", "content": "What is a KV cache?"},
    ]
    for name in ("llama3", "phi3", "gemma2"):
        directory = models[name][0]
        hf = AutoTokenizer.from_pretrained(directory)
        text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        expected = hf(text, add_special_tokens=False)["input_ids"]
        tokenizer = Tokenizer.from_dir(directory)
        assert tokenizer.apply_chat_template(messages) == text and len(expected) > 40, name
        engine_ids = chat_prompt_ids(tokenizer, messages)
        router = load_profiler(str(directory)).profile("/v1/chat/completions", {"messages": messages}, None)
        assert engine_ids == expected == list(router.prompts[0]), name


def test_unsupported_architectures_list_the_supported_ones() -> None:
    cfg = {"vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1}
    with pytest.raises(
        ValueError, match=r"unsupported model_type 'gpt2'; supported: llama, .*gemma2, gemma3_text"
    ):
        ModelArchConfig.from_dict({**cfg, "num_attention_heads": 2, "model_type": "gpt2"})
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'"):
        ModelArchConfig.from_dict(
            {**cfg, "num_attention_heads": 2, "model_type": "llama", "hidden_act": "relu"}
        )
    with pytest.raises(ValueError, match="layer_types must list 1"):
        ModelArchConfig.from_dict(
            {
                **cfg,
                "num_attention_heads": 2,
                "model_type": "gemma2",
                "layer_types": ["x"],
                "sliding_window": 4,
            }
        )


@pytest.mark.parametrize(
    "config_class", ["LlamaConfig", "Qwen3Config", "Phi3Config", "Gemma2Config", "Gemma3TextConfig"]
)
def test_keys_a_config_leaves_out_take_transformers_defaults(config_class: str) -> None:
    """A config.json with only the shape gives the architecture transformers' own config class fills in
    (Gemma: tied embeddings, a 4096-token window, Gemma 2's soft-caps, Gemma 3's two RoPE bases)."""
    import transformers

    shape = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    full = getattr(transformers, config_class)(**shape).to_dict()
    ours, theirs = (ModelArchConfig.from_dict(c) for c in ({**shape, "model_type": full["model_type"]}, full))
    for field in FAMILY_FIELDS:
        assert getattr(ours, field) == getattr(theirs, field), field


#: the fields the family switches set (``families.FamilyTraits``), and RoPE
FAMILY_FIELDS = (
    "tie_word_embeddings",
    "layer_windows",
    "attn_logit_softcap",
    "final_logit_softcap",
    "hidden_act",
    "qk_norm",
    "gemma_norms",
    "query_pre_attn_scalar",
    "qkv_bias",
    "o_bias",
    "rope_theta",
    "rope_scaling",
    "local_rope",
)


def test_gemma3_vision_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """``Gemma3ForConditionalGeneration`` (``model_type: gemma3``, a SigLIP tower beside the text model):
    the text model loads from under ``language_model.``, the tower is skipped, and text prompts give HF's
    greedy tokens and logprobs."""
    directory = build_family("gemma3-vision", tmp_path / "gemma3-vision")
    saved = json.loads((directory / "config.json").read_text())
    assert saved["model_type"] == "gemma3" and "vision_config" in saved
    arch = ModelArchConfig.from_dir(directory)
    assert arch.text_only and arch.layer_windows == (8, 8, None) and arch.local_rope == (10000.0, None)
    tokens, logprobs = hf_reference(load_hf(directory), LONG, STEPS)
    llm = LLM(str(directory), **ENGINE_ARGS)
    out = llm.generate([LONG], GREEDY)[0].outputs[0]
    assert out.token_ids == tokens
    ours = [step[t].logprob for t, step in zip(out.token_ids, out.logprobs, strict=True)]
    assert max(abs(a - b) for a, b in zip(ours, logprobs, strict=True)) < 1e-4
