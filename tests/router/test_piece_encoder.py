"""The router's per-piece encoder gives exactly the tokenizer's ids on ASCII text, knows which tokenizers it
can encode, and leaves everything else to the tokenizer."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from kvpilot.router.piece_encoder import PieceEncoder

# Characters where the GPT-2 regex's alternatives and its whitespace lookahead decide the split.
ALPHABET = "aZq 0719\t\n\r\x0b\x0c'sStrmvlld.,!?-_()[]{}<>|/\\\"#$%^&*+=~`@;:\x00\x1c\x1f\x7f"
FRAGMENTS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "  ", "\n\n", " \n ", "123", " 4", "hello", " world",
             "don't", "THE'S", "x  \ty", "a\r\nb", "?!", " .", "   end"]
ascii_texts = st.lists(st.one_of(st.text(alphabet=ALPHABET, max_size=12), st.sampled_from(FRAGMENTS)),
                       max_size=16).map("".join)


@pytest.fixture(scope="module")
def tiny_spec(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))


def backend_with(spec: dict) -> BackendTokenizer:
    return BackendTokenizer.from_str(json.dumps(spec))


def without_digit_splitting(spec: dict) -> dict:
    changed = copy.deepcopy(spec)
    changed["pre_tokenizer"] = changed["pre_tokenizer"]["pretokenizers"][1]
    return changed


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(ascii_texts, min_size=1, max_size=4), st.booleans(), st.booleans())
def test_ascii_text_encodes_exactly_as_the_tokenizer(tiny_spec, texts, split_digits, warm):
    spec = tiny_spec if split_digits else without_digit_splitting(tiny_spec)
    backend = backend_with(spec)
    encoder = PieceEncoder.for_spec(backend, spec)
    assert encoder is not None
    if warm:
        encoder.warm_from_vocabulary()
    for text in texts + texts:  # the second round comes from the piece cache
        assert encoder.encode(text) == backend.encode(text, add_special_tokens=False).ids


def test_each_piece_is_tokenized_once_and_digits_are_pieces_of_their_own(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    ids = encoder.encode("go go go 42")
    assert ids == backend.encode("go go go 42", add_special_tokens=False).ids
    assert encoder.cached_pieces == 5  # "go", " go", " ", "4", "2"


def test_warming_adds_the_vocabularys_ascii_pieces_each_as_the_tokenizer_splits_it(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    added = encoder.warm_from_vocabulary()
    vocab = backend.get_vocab(with_added_tokens=False)
    assert 0 < added == encoder.cached_pieces < len(vocab)  # "Ġ…" words and plain pieces, not "1a" or "é"
    pieces = list(encoder._cache.young.items())
    assert all(ids == tuple(backend.encode(piece, add_special_tokens=False).ids) for piece, ids in pieces)
    assert (" the", (vocab["Ġthe"],)) in pieces
    assert not any(not piece.isascii() for piece, _ in pieces)


def test_the_piece_cache_is_bounded(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder(backend, split_digits=True, max_pieces=8)
    words = [f" w{'x' * n}" for n in range(40)]
    for word in words:
        encoder.encode(word)
    assert encoder.cached_pieces <= 8
    assert encoder.encode("".join(words)) == backend.encode("".join(words), add_special_tokens=False).ids


def test_non_ascii_text_is_left_to_the_tokenizer(tiny_spec):
    encoder = PieceEncoder.for_spec(backend_with(tiny_spec), tiny_spec)
    assert encoder.encode("héllo") is None
    assert encoder.encode("") == []


@pytest.mark.parametrize("change", [
    lambda s: s.update(normalizer={"type": "NFC"}),
    lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
    lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(use_regex=False),
    lambda s: s["pre_tokenizer"]["pretokenizers"].__setitem__(0, {"type": "Digits", "individual_digits": False}),
    lambda s: s.update(pre_tokenizer={"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Isolated",
                                      "invert": False}),
    lambda s: s.update(pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}),
    lambda s: s.update(pre_tokenizer=None),
    lambda s: s["model"].update(dropout=0.1),
])
def test_tokenizers_it_cannot_reproduce_are_refused(tiny_spec, change):
    spec = copy.deepcopy(tiny_spec)
    change(spec)
    assert PieceEncoder.for_spec(None, spec) is None
