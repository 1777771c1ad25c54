"""A tiny seeded random-weights Llama in Hugging Face format, for fast exact tests.

``write_tiny_llama(path, seed)`` writes config.json, model.safetensors, generation_config.json,
tokenizer.json and tokenizer_config.json. Everything is a pure function of ``seed`` and the overrides, so
the directory (and its :func:`kvpilot.engine.model.registry.model_fingerprint`) is byte-identical across
processes and machines with the same torch version.

The tokenizer is byte-level BPE like SmolLM2's (digits split individually, then the GPT-2 regex): ids 0-2
are ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``, ids 3-258 the 256 bytes (so any UTF-8 text
round-trips), and the rest merges learned deterministically from a small built-in English corpus.

Overrides are config.json keys. ``model_type="qwen2"`` gives Qwen2's q/k/v biases (written as
``attention_bias: true``), ``"mistral"`` honours ``sliding_window``; for Llama ``attention_bias`` adds
q/k/v/o biases and ``mlp_bias`` MLP biases; ``tie_word_embeddings=False`` adds an ``lm_head``. The
weights always match the parameter set of the HF class ``architectures`` names.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from kvpilot.engine.model.gguf_tokenizer import TokenizerFiles, build_byte_level_bpe, tokenizer_config

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
UNK_ID, BOS_ID, EOS_ID = 0, 1, 2
_FIRST_BYTE_ID = len(SPECIAL_TOKENS)
MIN_VOCAB_SIZE = _FIRST_BYTE_ID + 256

TINY_DEFAULTS: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
}
# Keys a caller may add beyond the defaults (the variant-specific ones HF's config classes read).
_EXTRA_KEYS = frozenset({"sliding_window", "use_sliding_window", "max_window_layers"})
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}

# Standard deviations of the random weights. Embeddings at 0.1 give logits with a spread of about one
# unit, so greedy argmax margins are large compared to float32 rounding; linear layers at 1/sqrt(fan_in)
# keep activations O(1) through the layers; norm weights around 1 (not exactly 1) so that a loader which
# drops them changes the output.
_EMBEDDING_STD = 0.1
_NORM_STD = 0.1
_BIAS_STD = 0.1

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unknown role: ' + message['role']) }}{% endif %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Merges are learned from this text; it only needs enough distinct words for the default vocabulary.
_CORPUS = """
A key value cache keeps the keys and values of every token a model has already seen, so that each new
token only needs one more step of attention instead of a whole new pass over the prompt. Paged attention
stores that cache in fixed blocks, the way an operating system stores memory in pages, which lets many
requests share one pool without fragmentation. When two requests begin with the same system prompt, the
blocks that hold it can be shared as well: this is prefix caching, and it turns a repeated prompt into a
lookup. The scheduler decides, at every step, which requests run: decoding requests first, because a user
is waiting for their next word, and then waiting requests, whose prompts are split into chunks so that a
long document does not stall everyone else. If memory runs out, the newest request is preempted and its
blocks are freed; later it is recomputed from its tokens. A router in front of several replicas sends each
request where its prefix is already cached, unless that replica is much busier than the others. Hello,
world! How are you today? I am fine, thank you. The quick brown fox jumps over the lazy dog. What time is
it? It is seven o'clock in the morning and the sun is shining over the mountains near the river. Please
write a short story about a small robot who learns to paint pictures of flowers, birds and the ocean.
"""


def write_tiny_llama(path: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """Write the tiny model for ``seed`` (and config ``overrides``) into ``path``; returns ``path``."""
    config = tiny_config(**overrides)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(_random_weights(config, seed), str(path / "model.safetensors"), metadata={"format": "pt"})
    _tiny_tokenizer(config["vocab_size"], config["max_position_embeddings"]).write(path)
    _write_json(path / "config.json", config)
    _write_json(
        path / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": EOS_ID},
    )
    return path


def write_tiny_tokenizer(
    path: str | Path, vocab_size: int, model_max_length: int, chat_template: str = ""
) -> None:
    """The tiny byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) of ``vocab_size`` tokens
    into ``path``, for tiny models of other families built by transformers itself (tests); its chat template
    is ``chat_template``, or the tiny model's ChatML one."""
    _tiny_tokenizer(vocab_size, model_max_length, chat_template or TINY_CHAT_TEMPLATE).write(Path(path))


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """The config.json of the tiny model with ``overrides`` applied and checked."""
    unknown = set(overrides) - set(TINY_DEFAULTS) - _EXTRA_KEYS
    if unknown:
        raise ValueError(
            f"unknown tiny-model override(s) {sorted(unknown)}; "
            f"accepted: {sorted(set(TINY_DEFAULTS) | _EXTRA_KEYS)}"
        )
    config = {**TINY_DEFAULTS, **overrides}
    if config["model_type"] not in _ARCHITECTURES:
        raise ValueError(f"model_type must be one of {sorted(_ARCHITECTURES)}, got {config['model_type']!r}")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        value = config[key]
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{key} must be a positive int, got {value!r}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    if config["vocab_size"] < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be at least {MIN_VOCAB_SIZE} (3 special tokens + 256 bytes)")
    _apply_bias_rules(config, overrides)
    config.update(
        architectures=[_ARCHITECTURES[config["model_type"]]],
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        torch_dtype="float32",
    )
    return dict(sorted(config.items()))


def _apply_bias_rules(config: dict[str, Any], overrides: dict[str, Any]) -> None:
    # Qwen2 always has q/k/v biases (and no o_proj/MLP bias); config.json says so with attention_bias=true,
    # which HF's Qwen2 ignores and kvpilot's arch reads. Mistral has no biases at all.
    model_type = config["model_type"]
    if model_type == "qwen2":
        if overrides.get("attention_bias") is False:
            raise ValueError(
                "Qwen2 always has q/k/v biases; attention_bias=False contradicts model_type='qwen2'"
            )
        config["attention_bias"] = True
    elif model_type == "mistral" and config["attention_bias"]:
        raise ValueError("Mistral has no attention biases; use model_type='llama' for attention_bias=True")
    if model_type != "llama" and config["mlp_bias"]:
        raise ValueError(f"mlp_bias is a Llama option; {model_type} has no MLP biases")


def _random_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32) * std + mean

    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    q_rows = config["num_attention_heads"] * config["head_dim"]
    kv_rows = config["num_key_value_heads"] * config["head_dim"]
    qkv_bias = config["attention_bias"]
    o_bias = config["attention_bias"] and config["model_type"] != "qwen2"
    # (name suffix, output rows, input features, has bias); the draw order below is part of the format.
    projections = [
        ("self_attn.q_proj", q_rows, hidden, qkv_bias),
        ("self_attn.k_proj", kv_rows, hidden, qkv_bias),
        ("self_attn.v_proj", kv_rows, hidden, qkv_bias),
        ("self_attn.o_proj", hidden, q_rows, o_bias),
        ("mlp.gate_proj", inter, hidden, config["mlp_bias"]),
        ("mlp.up_proj", inter, hidden, config["mlp_bias"]),
        ("mlp.down_proj", hidden, inter, config["mlp_bias"]),
    ]
    weights = {"model.embed_tokens.weight": normal(vocab, hidden, std=_EMBEDDING_STD)}
    for layer in range(config["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        weights[prefix + "input_layernorm.weight"] = normal(hidden, std=_NORM_STD, mean=1.0)
        weights[prefix + "post_attention_layernorm.weight"] = normal(hidden, std=_NORM_STD, mean=1.0)
        for name, rows, cols, has_bias in projections:
            weights[f"{prefix}{name}.weight"] = normal(rows, cols, std=cols**-0.5)
            if has_bias:
                weights[f"{prefix}{name}.bias"] = normal(rows, std=_BIAS_STD)
    weights["model.norm.weight"] = normal(hidden, std=_NORM_STD, mean=1.0)
    if not config["tie_word_embeddings"]:
        weights["lm_head.weight"] = normal(vocab, hidden, std=_EMBEDDING_STD)
    return weights


def _tiny_tokenizer(
    vocab_size: int, model_max_length: int, chat_template: str = TINY_CHAT_TEMPLATE
) -> TokenizerFiles:
    # ByteLevel spells byte b as bytes_to_unicode()[b]; listing them by b gives ids 3..258 in byte order.
    tokens = list(SPECIAL_TOKENS) + [symbol for _, symbol in sorted(bytes_to_unicode().items())]
    merges = _learn_merges(vocab_size - len(tokens))
    known = set(tokens)
    for left, right in merges:
        if left + right not in known:
            known.add(left + right)
            tokens.append(left + right)
    tokenizer = build_byte_level_bpe(
        tokens, merges, special_ids=range(len(SPECIAL_TOKENS)), split_digits=True
    )
    config = tokenizer_config(
        tokens,
        chat_template,
        model_max_length,
        bos_id=BOS_ID,
        eos_id=EOS_ID,
        pad_id=EOS_ID,
        unk_id=UNK_ID,
    )
    return TokenizerFiles(tokenizer_json=tokenizer.to_str(pretty=True), tokenizer_config=config)


def _learn_merges(new_tokens: int) -> list[tuple[str, str]]:
    """Greedy BPE on the corpus: the most frequent adjacent pair wins, ties to the smallest pair."""
    splitter = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    words = Counter(tuple(word) for word, _ in splitter.pre_tokenize_str(_CORPUS))
    merges: list[tuple[str, str]] = []
    produced: set[str] = set()
    while len(produced) < new_tokens:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in itertools.pairwise(word):
                pairs[pair] += count
        if not pairs:
            raise ValueError(
                f"the tiny tokenizer's corpus yields only {len(produced)} merges; "
                f"vocab_size can be at most {MIN_VOCAB_SIZE + len(produced)}"
            )
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        produced.add(best[0] + best[1])
        words = Counter({_merge_word(word, best): count for word, count in words.items()})
    return merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    merged: list[str] = []
    i = 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            merged.append(word[i] + word[i + 1])
            i += 2
        else:
            merged.append(word[i])
            i += 1
    return tuple(merged)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (what HF's ByteLevel pre-tokenizer uses)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
