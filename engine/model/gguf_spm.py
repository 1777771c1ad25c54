"""SentencePiece vocabularies of GGUFs (``tokenizer.ggml.model = llama``: Gemma, Phi-3, Llama 2) as an HF
``tokenizers`` BPE tokenizer that splits text as the model's own tokenizer does (docs/models.md#gguf).

A SentencePiece BPE model, as llama.cpp's SPM tokenizer and HF's conversion of ``tokenizer.model`` both run
it: spaces become ``▁``; with ``add_space_prefix`` (llama.cpp's default; Gemma's files say false) the text
at the start and after each special token gets a leading ``▁``; the characters are merged pairwise, always
the adjacent pair whose concatenation is the highest-scored piece (leftmost first), until no pair makes a
piece; a character that is no piece becomes its UTF-8 bytes ``<0xXX>`` (byte fallback). In ``tokenizers``
that is ``models.BPE(byte_fallback=True)`` whose merges are every split ``(a, b)`` of every normal piece
into two normal pieces, ranked by the piece's score (then id): the merges transformers derives from a
``tokenizer.model`` (``SpmConverter``). ``Prepend`` then ``Replace`` normalizers add the prefix to every
run of text between added tokens, as llama.cpp does. Control tokens become special added tokens and
user-defined ones non-special added tokens (both matched whole in the text).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

# llama.cpp's llama_token_type values (gguf.TokenType)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
SPACE = "▁"


def spm_merges(tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two normal pieces, highest-scored piece first (ties by id)."""
    normal = {t: i for i, t in enumerate(tokens) if types[i] == TOKEN_TYPE_NORMAL}
    ranked = []
    for token, index in normal.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in normal and right in normal:
                ranked.append((-float(scores[index]), index, normal[left], normal[right], left, right))
    return [(left, right) for *_, left, right in sorted(ranked)]


def build_spm_bpe(
    tokens: Sequence[str],
    scores: Sequence[float],
    types: Sequence[int],
    add_space_prefix: bool,
    bos_id: int | None = None,
    eos_id: int | None = None,
    add_bos: bool = False,
    add_eos: bool = False,
) -> Tokenizer:
    """The tokenizer of a SentencePiece BPE vocabulary (module docstring); token ``i`` is ``tokens[i]``."""
    if not len(tokens) == len(scores) == len(types):
        raise ValueError(f"GGUF has {len(tokens)} tokens, {len(scores)} scores and {len(types)} token types")
    vocab = {token: index for index, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError("tokenizer vocabulary has duplicate tokens; token ids would be ambiguous")
    unknown = next((tokens[i] for i, kind in enumerate(types) if kind == TOKEN_TYPE_UNKNOWN), None)
    model = models.BPE(
        vocab=vocab,
        merges=spm_merges(tokens, scores, types),
        unk_token=unknown,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(model)
    escape = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (
        normalizers.Sequence([normalizers.Prepend(SPACE), escape]) if add_space_prefix else escape
    )
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # after Fuse: Strip works per token, so only the text's first space goes
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.post_processor = _bos_eos(tokens, bos_id if add_bos else None, eos_id if add_eos else None)
    # Added in id order so the added-token table is deterministic (it ends up in tokenizer.json).
    tokenizer.add_special_tokens(
        [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, k in enumerate(types)
            if k == TOKEN_TYPE_CONTROL
        ]
    )
    user = [i for i, kind in enumerate(types) if kind == TOKEN_TYPE_USER_DEFINED]
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False) for i in user])
    return tokenizer


def spm_tokenizer_from_gguf(
    metadata: Mapping[str, Any], token_id: Callable[[str], int | None]
) -> tuple[Tokenizer, bool]:
    """(tokenizer, whether it prepends BOS) from a GGUF's ``tokenizer.ggml.*`` metadata; ``token_id(key)``
    reads and checks one special token id."""
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    if "tokenizer.ggml.scores" not in metadata:
        raise ValueError("GGUF SentencePiece vocabulary has no tokenizer.ggml.scores to rank its merges by")
    scores = list(metadata["tokenizer.ggml.scores"])
    types = list(metadata.get("tokenizer.ggml.token_type", [TOKEN_TYPE_NORMAL] * len(tokens)))
    bos_id, eos_id = token_id("bos_token_id"), token_id("eos_token_id")
    # llama.cpp's SPM defaults: BOS added, no EOS, a space prefix
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    tokenizer = build_spm_bpe(
        tokens,
        scores,
        types,
        add_space_prefix=bool(metadata.get("tokenizer.ggml.add_space_prefix", True)),
        bos_id=bos_id,
        eos_id=eos_id,
        add_bos=add_bos,
        add_eos=add_eos,
    )
    return tokenizer, add_bos


def _bos_eos(tokens: Sequence[str], bos_id: int | None, eos_id: int | None) -> processors.TemplateProcessing:
    first = [f"{tokens[bos_id]}:0"] if bos_id is not None else []
    last = [f"{tokens[eos_id]}:0"] if eos_id is not None else []
    special = [(tokens[i], i) for i in dict.fromkeys(i for i in (bos_id, eos_id) if i is not None)]
    single = " ".join([*first, "$A:0", *last])
    return processors.TemplateProcessing(single=single, pair=f"{single} $B:1", special_tokens=special)
