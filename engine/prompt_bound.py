"""A lower bound on a text's token count without tokenizing it, so a prompt far beyond the context (an 8 MB
body is ~4M tokens and ~6 s of tokenizing on one core) is refused by its length alone.

One token stands for at most ``C`` characters, the longest string in the vocabulary (added tokens included;
a byte-level vocabulary spells each byte as one character, and a text has at least as many UTF-8 bytes as
characters). So a text of ``N`` characters has at least ``ceil(N / C)`` tokens — provided nothing between
the text and the vocabulary removes characters or lets one token swallow an unbounded run. That holds for
the byte-level and byte-fallback BPE tokenizers of current LLMs; for anything else (a normalizer or
pre-tokenizer that strips characters, an unknown token fused over runs, added tokens that absorb
whitespace, truncation) :func:`max_chars_per_token` says None and prompts are only checked after
tokenizing. Unicode composition (NFC/NFKC) merges at most 4 characters into one, which scales ``C``.

No torch here: the router can bound prompts the same way.
"""

from __future__ import annotations

import json
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from kvpilot.engine.tokenizer import Tokenizer

#: the most characters canonical composition turns into one (the longest NFD of any code point, e.g. U+1FAF)
COMPOSED_MAX = 4
# Normalizers and pre-tokenizers that never drop a character (each maps a character to one or more).
_KEEPING_NORMALIZERS = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Digits", "UnicodeScripts"})
_SPLITTING_PRE_TOKENIZERS = frozenset({"Split", "Punctuation"})  # keep characters unless "Removed"


def max_chars_per_token(tokenizer: Tokenizer) -> int | None:
    """The most characters of text one token can stand for, or None where no such bound is sound."""
    backend = tokenizer.backend
    shrink = _normalizer_shrink(_state(backend.normalizer))
    if (
        shrink is None
        or not _keeps_characters(_state(backend.pre_tokenizer))
        or not _model_is_bounded(backend)
    ):
        return None
    if backend.truncation is not None:
        return None  # a truncating tokenizer makes any text fit; the token check decides as before
    if any(t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None  # such an added token also takes the whitespace run beside it
    longest = max((len(token) for token in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(longest, 1) * shrink


def min_tokens(chars: int, chars_per_token: int) -> int:
    """Fewest tokens a text of ``chars`` characters can encode to: ``ceil(chars / chars_per_token)``."""
    return -(-chars // chars_per_token)


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """How many characters the normalizer may turn into one (1: none), or None if it may drop some."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind == "Sequence":
        factor = 1
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            factor *= shrink
        return factor
    if kind in _KEEPING_NORMALIZERS:
        return 1
    if kind in _COMPOSING_NORMALIZERS:
        return COMPOSED_MAX
    if kind == "Replace":  # a literal replaced by a non-empty one shrinks by their length ratio at most
        pattern, content = spec.get("pattern", {}).get("String"), spec.get("content", "")
        if isinstance(pattern, str) and pattern and content:
            return -(-len(pattern) // len(content))
    return None  # Strip, StripAccents, BertNormalizer (drops controls), Precompiled, regex Replace, ...


def _keeps_characters(spec: dict[str, Any] | None) -> bool:
    if spec is None:
        return True
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_keeps_characters(part) for part in spec.get("pretokenizers", []))
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return spec.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS  # Whitespace, WhitespaceSplit, Bert drop whitespace


def _model_is_bounded(backend: BackendTokenizer) -> bool:
    """False where one unknown token may stand for a run of any length."""
    model = backend.model
    kind = type(model).__name__
    if kind == "BPE":
        return not (model.unk_token and model.fuse_unk and not model.byte_fallback)
    if kind == "Unigram":  # fuses unknown runs into one token unless it falls back to bytes
        return bool((_state(model) or {}).get("byte_fallback"))
    return False  # WordPiece and WordLevel make a whole unknown word one token
