"""Build Hugging Face tokenizer files (tokenizer.json, tokenizer_config.json) for byte-level BPE models.

Two callers: the GGUF converter (vocabulary, merges and token types come from the file's
``tokenizer.ggml.*`` metadata) and the tiny test model (its own small vocabulary). Both produce the same
shape of tokenizer, so the engine's :class:`kvpilot.engine.tokenizer.Tokenizer` loads either the same way.

Byte-level BPE (``tokenizer.ggml.model == "gpt2"``) converts with the pre-tokenizers whose llama.cpp
behaviour we can reproduce exactly in HF ``tokenizers``, and SentencePiece BPE (``llama``: Gemma, Phi-3)
through ``gguf_spm``; anything else is refused with a clear error rather than converted into a tokenizer
that silently splits text differently from the model's own.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvpilot.engine.model.gguf_spm import spm_tokenizer_from_gguf

# llama.cpp's llama_token_type values (gguf.TokenType); only these two change how text is split.
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp pre-tokenizer names that use `\p{N}` (each digit alone) followed by the GPT-2 regex: in
# HF tokenizers that is Digits(individual_digits=True) then ByteLevel(use_regex=True).
_DIGIT_SPLITTING_PRE = frozenset(
    {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
)
# llama.cpp pre-tokenizer names that use the plain GPT-2 regex.
_GPT2_REGEX_PRE = frozenset({"gpt-2", "gpt2"})
# llama.cpp pre-tokenizers with their own split regex, as the models' HF tokenizer.json spells it (a Split
# before a ByteLevel without its own regex): Qwen2's (Qwen2/2.5/3 GGUFs) keeps single digits and
# case-insensitive contractions.
_SPLIT_REGEX_PRE = {
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+",
}
SUPPORTED_PRE_TOKENIZERS = tuple(sorted(_DIGIT_SPLITTING_PRE | _GPT2_REGEX_PRE | set(_SPLIT_REGEX_PRE)))
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")


@dataclass(frozen=True)
class TokenizerFiles:
    """The two JSON documents an HF-format model directory needs for its tokenizer."""

    tokenizer_json: str
    tokenizer_config: dict[str, Any]

    def write(self, directory: Path) -> None:
        (directory / "tokenizer.json").write_text(self.tokenizer_json, encoding="utf-8")
        (directory / "tokenizer_config.json").write_text(
            json.dumps(self.tokenizer_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
        )


def build_byte_level_bpe(
    tokens: Sequence[str],
    merges: Sequence[tuple[str, str]],
    special_ids: Iterable[int],
    user_defined_ids: Iterable[int] = (),
    split_digits: bool = True,
    bos_id: int | None = None,
    add_bos: bool = False,
    split_regex: str | None = None,
) -> Tokenizer:
    """A byte-level BPE tokenizer whose token ``i`` is ``tokens[i]``.

    ``special_ids`` become special added tokens (matched whole in text, dropped by
    ``decode(skip_special_tokens=True)``); ``user_defined_ids`` become non-special added tokens (matched
    whole, kept when decoding). ``add_bos`` prepends ``bos_id`` when encoding with special tokens.
    ``split_regex`` replaces the GPT-2 regex (and ``split_digits``) by that pattern's pieces.
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer vocabulary has duplicate tokens; token ids would be ambiguous")
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split_regex is None)
    if split_regex is not None:
        split = pre_tokenizers.Split(Regex(split_regex), behavior="isolated", invert=False)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif split_digits:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    offsets = processors.ByteLevel(trim_offsets=False)
    if add_bos:
        if bos_id is None:
            raise ValueError("add_bos=True needs a bos_id")
        bos = tokens[bos_id]
        prepend_bos = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, bos_id)]
        )
        tokenizer.post_processor = processors.Sequence([offsets, prepend_bos])
    else:
        tokenizer.post_processor = offsets
    # Added in id order so the added-token table is deterministic (it ends up in tokenizer.json).
    tokenizer.add_special_tokens(
        [AddedToken(tokens[i], special=True, normalized=False) for i in sorted(set(special_ids))]
    )
    tokenizer.add_tokens(
        [AddedToken(tokens[i], special=False, normalized=False) for i in sorted(set(user_defined_ids))]
    )
    return tokenizer


def tokenizer_config(
    tokens: Sequence[str],
    chat_template: str | None,
    model_max_length: int,
    bos_id: int | None,
    eos_id: int | None,
    pad_id: int | None = None,
    unk_id: int | None = None,
    add_bos: bool = False,
) -> dict[str, Any]:
    """tokenizer_config.json in the form HF transformers writes it for a fast tokenizer."""
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    for name, token_id in (
        ("bos_token", bos_id),
        ("eos_token", eos_id),
        ("pad_token", pad_id),
        ("unk_token", unk_id),
    ):
        if token_id is not None:
            config[name] = tokens[token_id]
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def tokenizer_files_from_gguf(metadata: Mapping[str, Any], model_max_length: int) -> TokenizerFiles:
    """Rebuild the tokenizer described by a GGUF's ``tokenizer.*`` metadata (already parsed to Python)."""
    kind = metadata.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(
            f"GGUF tokenizer model {kind!r} is not supported; supported: 'gpt2' (byte-level BPE) and "
            "'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])

    def token_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        if not 0 <= int(value) < len(tokens):
            raise ValueError(f"GGUF tokenizer.ggml.{key}={value} is outside the vocabulary of {len(tokens)}")
        return int(value)

    if kind == "llama":
        tokenizer, add_bos = spm_tokenizer_from_gguf(metadata, token_id)
    else:
        tokenizer, add_bos = _byte_level_from_gguf(metadata, tokens, token_id)
    config = tokenizer_config(
        tokens,
        chat_template=metadata.get("tokenizer.chat_template"),
        model_max_length=model_max_length,
        bos_id=token_id("bos_token_id"),
        eos_id=token_id("eos_token_id"),
        pad_id=token_id("padding_token_id"),
        unk_id=token_id("unknown_token_id"),
        add_bos=add_bos,
    )
    return TokenizerFiles(tokenizer_json=tokenizer.to_str(pretty=True), tokenizer_config=config)


def _byte_level_from_gguf(
    metadata: Mapping[str, Any], tokens: list[str], token_id: Callable[[str], int | None]
) -> tuple[Tokenizer, bool]:
    pre = metadata.get("tokenizer.ggml.pre", "gpt-2")
    if pre not in SUPPORTED_PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(SUPPORTED_PRE_TOKENIZERS)}"
        )
    token_types: list[int] = list(metadata.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    if len(token_types) != len(tokens):
        raise ValueError(f"GGUF has {len(tokens)} tokens but {len(token_types)} token types")
    merges = [_split_merge(merge) for merge in metadata.get("tokenizer.ggml.merges", [])]
    bos_id = token_id("bos_token_id")
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", False)) and bos_id is not None
    tokenizer = build_byte_level_bpe(
        tokens,
        merges,
        special_ids=[i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_CONTROL],
        user_defined_ids=[i for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_USER_DEFINED],
        split_digits=pre in _DIGIT_SPLITTING_PRE,
        bos_id=bos_id,
        add_bos=add_bos,
        split_regex=_SPLIT_REGEX_PRE.get(pre),
    )
    return tokenizer, add_bos


def _split_merge(merge: str) -> tuple[str, str]:
    # Byte-level tokens never contain a literal space (it is spelled "Ġ"), so one space separates the pair.
    parts = merge.split(" ")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"malformed BPE merge {merge!r}: expected two tokens separated by one space")
    return parts[0], parts[1]
