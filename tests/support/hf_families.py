"""Tiny random models of each dense family, built and saved by the installed transformers itself.

``build_family(name, path)`` instantiates transformers' own config and model classes with a seeded tiny
shape, redraws the weights at scales that keep greedy margins well above float32 rounding (HF's 0.02
initialisation gives near-uniform logits), saves them with ``save_pretrained`` (so config.json is in this
transformers' current format) and adds kvpilot's tiny byte-level tokenizer with the family's chat format.
``hf_reference`` replays HF eager generation one token at a time with its own KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers

from kvpilot.engine.model.tiny import write_tiny_tokenizer

VOCAB = 320
MAX_POS = 128
_BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": MAX_POS,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
    "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
# head_dim 16: 8 frequency pairs
PHI3_ROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
    "long_factor": [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 13.0, 18.0],
}

#: name -> (config class, model class, config overrides, chat template)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", {"rope_parameters": LLAMA3_ROPE}, LLAMA3_TEMPLATE),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            # layer 1 slides (HF: from max_window_layers on), layer 0 does not
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        },
        "",
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        # prompts stay inside the original context (HF's one-shot prefill of a longer prompt would rotate
        # it all with the long factors, docs/models.md#phi-3); generation crosses it at position 24
        {"rope_parameters": PHI3_ROPE, "original_max_position_embeddings": 24, "sliding_window": 24},
        PHI3_TEMPLATE,
    ),
    # Phi-4-mini's layout: RoPE (LongRoPE) on the first 3/4 of each head only, 6 frequency pairs of 16 dims
    "phi3-partial": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "rope_parameters": {
                **PHI3_ROPE,
                "partial_rotary_factor": 0.75,
                "short_factor": PHI3_ROPE["short_factor"][:6],
                "long_factor": PHI3_ROPE["long_factor"][:6],
            },
            "original_max_position_embeddings": 24,
        },
        PHI3_TEMPLATE,
    ),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "sliding_window": 8,
            "query_pre_attn_scalar": 24,
            # small caps so the tiny model's logits really bend (real Gemma 2: 50 and 30)
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
        GEMMA_TEMPLATE,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "sliding_window": 8,
            "sliding_window_pattern": 3,  # local, local, global
            "query_pre_attn_scalar": 16,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            },
        },
        GEMMA_TEMPLATE,
    ),
}


#: Gemma 3's vision-language checkpoint: the text model of ``gemma3`` under a tiny SigLIP tower
GEMMA3_VISION = {
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "image_size": 28,
        "patch_size": 14,
    },
    "mm_tokens_per_image": 4,
    "image_token_index": 300,
    "boi_token_index": 301,
    "eoi_token_index": 302,
}


def build_family(name: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """``name`` of ``FAMILIES``, or ``gemma3-vision`` (``Gemma3ForConditionalGeneration`` around the
    ``gemma3`` text model)."""
    if name == "gemma3-vision":
        _, _, family, template = FAMILIES["gemma3"]
        text = transformers.Gemma3TextConfig(**{**_BASE, **family, **overrides}).to_dict()
        config = transformers.Gemma3Config(text_config=text, **GEMMA3_VISION)
        return _save(transformers.Gemma3ForConditionalGeneration, config, path, seed, True, template)
    config_class, model_class, family, template = FAMILIES[name]
    config = getattr(transformers, config_class)(**{**_BASE, **family, **overrides})
    return _save(getattr(transformers, model_class), config, path, seed, name.startswith("gemma"), template)


def _save(model_class: Any, config: Any, path: Path, seed: int, gemma: bool, template: str) -> Path:
    torch.manual_seed(seed)
    model = model_class(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if param.dim() == 1 and "norm" in param_name:  # Gemma's (1 + w) norms are centred on 0
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1 + (0.0 if gemma else 1.0))
            elif param.dim() == 1:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            else:
                std = 0.1 if "embed" in param_name or "lm_head" in param_name else param.shape[1] ** -0.5
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    model.save_pretrained(path)
    write_tiny_tokenizer(path, VOCAB, MAX_POS, template)
    return path


def load_hf(path: Path) -> torch.nn.Module:
    config = json.loads((path / "config.json").read_text())
    model_class = getattr(transformers, config["architectures"][0])
    return model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def hf_reference(
    model: torch.nn.Module,
    prompt: list[int],
    steps: int,
    choose: Callable[[int, torch.Tensor], int] | None = None,
) -> tuple[list[int], list[float]]:
    """HF eager decoding with its KV cache, one token per forward: the tokens (argmax, or ``choose(step,
    logprobs)``) and each one's logprob."""
    tokens: list[int] = []
    logprobs: list[float] = []
    with torch.no_grad():
        out = model(torch.tensor([prompt]), use_cache=True)
        for step in range(steps):
            lp = out.logits[0, -1].float().log_softmax(-1)
            token = int(lp.argmax()) if choose is None else choose(step, lp)
            tokens.append(token)
            logprobs.append(float(lp[token]))
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens, logprobs
