"""RoPE parameters from both HF config forms, against HF transformers with the same weights.

transformers >= 5 saves ``rope_parameters`` (theta, type and scaling keys in one dict); older configs carry
``rope_theta`` and ``rope_scaling``. Each scaling type is written both ways and must give HF's greedy
tokens and logprobs, token by token (HF recomputes dynamic NTK frequencies per step, so generation crosses
the original context in the dynamic case). A negative control shows the variants differ from plain RoPE
by far more than the tolerance, so reading the config wrongly would fail.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_families import hf_reference
from transformers import LlamaConfig
from transformers import LlamaForCausalLM as HFLlama

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.rope_config import rope_settings
from kvpilot.engine.model.tiny import write_tiny_llama

MAX_POS = 32
PROMPT = [(11 * i + 5) % 400 + 3 for i in range(12)]
# the whole context; dynamic NTK and YaRN serve 64 positions here, so generation crosses the original 32
NEW_TOKENS = {"dynamic": 44, "yarn": 44}

VARIANTS = {
    "default-theta": {"rope_type": "default", "rope_theta": 500000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def write_model(root: Path, name: str, rope: dict, form: str) -> Path:
    """The tiny model's weights and tokenizer with this RoPE, config.json written in ``form``:
    ``v5`` by transformers' own ``save_pretrained``, ``legacy`` as rope_theta + rope_scaling."""
    directory = write_tiny_llama(root / f"{name}-{form}", seed=3, max_position_embeddings=MAX_POS)
    if form == "v5":
        config = LlamaConfig.from_pretrained(directory)
        config.rope_parameters = dict(rope)
        config.save_pretrained(directory)
        saved = json.loads((directory / "config.json").read_text())
        assert "rope_parameters" in saved and "rope_scaling" not in saved  # really the new form
    else:
        saved = json.loads((directory / "config.json").read_text())
        saved["rope_theta"] = rope["rope_theta"]
        scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        saved["rope_scaling"] = None if rope["rope_type"] == "default" else scaling
        (directory / "config.json").write_text(json.dumps(saved))
    return directory


def hf_greedy_logprobs(directory: Path, count: int) -> tuple[list[int], list[float]]:
    """HF forward with its own KV cache, one token at a time: argmax and its logprob each step."""
    hf = HFLlama.from_pretrained(directory, dtype=torch.float32).eval()
    return hf_reference(hf, PROMPT, count)


def kvpilot_greedy_logprobs(directory: Path, count: int) -> tuple[list[int], list[float]]:
    llm = LLM(str(directory), num_kv_blocks=64, block_size=4, enable_prefix_caching=False)
    out = llm.generate(
        [PROMPT], SamplingParams(temperature=0.0, max_tokens=count, ignore_eos=True, logprobs=0)
    )[0].outputs[0]
    return out.token_ids, [step[tok].logprob for tok, step in zip(out.token_ids, out.logprobs, strict=True)]


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory) -> list[float]:
    root = tmp_path_factory.mktemp("rope-plain")
    plain = write_model(root, "plain", {"rope_type": "default", "rope_theta": 10000.0}, "legacy")
    return hf_greedy_logprobs(plain, max(NEW_TOKENS.values()))[1]


@pytest.mark.parametrize("form", ["v5", "legacy"])
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_rope_variant_matches_hf(tmp_path: Path, plain_reference: list[float], name: str, form: str) -> None:
    directory = write_model(tmp_path, name, VARIANTS[name], form)
    count = NEW_TOKENS.get(name, MAX_POS - len(PROMPT))
    hf_tokens, hf_lps = hf_greedy_logprobs(directory, count)
    tokens, lps = kvpilot_greedy_logprobs(directory, count)
    assert tokens == hf_tokens
    assert max(abs(a - b) for a, b in zip(lps, hf_lps, strict=True)) < 1e-4
    # negative control: the variant's distribution is not plain RoPE's, so misreading it would fail (for
    # dynamic NTK only past the original context: within it both are the same)
    assert max(abs(a - b) for a, b in zip(hf_lps, plain_reference, strict=False)) > 1e-3


def test_v5_form_reads_theta_scaling_and_served_length() -> None:
    base = {"max_position_embeddings": 32}
    assert rope_settings({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}) == (
        5e5,
        None,
        32,
    )
    assert rope_settings(
        {**base, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}
    ) == (1e4, {"rope_type": "dynamic", "factor": 2.0, "original_max_position_embeddings": 32}, 64)
    assert (
        rope_settings(
            {
                **base,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 16,
                },
            }
        )[2]
        == 64
    )
    assert rope_settings({**base, "rope_theta": 7.0, "rope_scaling": {"type": "linear", "factor": 2.0}}) == (
        7.0,
        {"rope_type": "linear", "factor": 2.0},
        32,
    )
    assert rope_settings(base) == (10000.0, None, 32)
    arch = ModelArchConfig.from_dict(
        {
            **base,
            "vocab_size": 8,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 3.0},
        }
    )
    assert (arch.rope_theta, arch.max_position_embeddings) == (1e4, 96)


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}},
            r"'longrope' needs short_factor as a list of rotated dims / 2",
        ),
        ({"rope_parameters": {"rope_type": "ntk-by-parts", "rope_theta": 1e4}}, "unsupported RoPE type"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per layer type"),
        (
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "needs a 'factor'"),
        ({"rope_parameters": [1, 2]}, "must be an object"),
    ],
)
def test_unsupported_rope_configs_are_refused_clearly(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rope_settings({"max_position_embeddings": 32, **cfg})
