"""The router's per-piece encoder gives exactly the tokenizer's ids on ASCII text, knows which tokenizers it
can encode, and leaves everything else to the tokenizer."""

from __future__ import annotations

import copy
import json
from array import array

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer

from kvpilot.router.piece_encoder import PieceEncoder

# Characters where the GPT-2 regex's alternatives and its whitespace lookahead decide the split.
ALPHABET = "aZq 0719\t\n\r\x0b\x0c'sStrmvlld.,!?-_()[]{}<>|/\\\"#$%^&*+=~`@;:\x00\x1c\x1f\x7f"
FRAGMENTS = [
    "'s",
    "'t",
    "'re",
    "'ve",
    "'m",
    "'ll",
    "'d",
    "  ",
    "\n\n",
    " \n ",
    "123",
    " 4",
    "hello",
    " world",
    "don't",
    "THE'S",
    "x  \ty",
    "a\r\nb",
    "?!",
    " .",
    "   end",
]
ascii_texts = st.lists(
    st.one_of(st.text(alphabet=ALPHABET, max_size=12), st.sampled_from(FRAGMENTS)), max_size=16
).map("".join)
# Text as prose is: words joined by single spaces (the encoder's word path), with whitespace, digits and
# contractions at the words' ends, and now and then an empty word (a double space).
WORD_ALPHABET = ALPHABET.replace(" ", "")
words = st.one_of(
    st.text(alphabet=WORD_ALPHABET, max_size=6), st.sampled_from(["the", "42", "it's", "x\n", "\t7"])
)
prose = st.lists(words, min_size=1, max_size=24).map(" ".join)


@pytest.fixture(scope="module")
def tiny_spec(tiny_model_dir) -> dict:
    return json.loads((tiny_model_dir / "tokenizer.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def smollm2_backends(smollm2_dir) -> dict[bool, tuple[dict, BackendTokenizer]]:
    """A real vocabulary (its whitespace and digit merges make a wrong piece boundary visible in the ids),
    with and without digit splitting: split_digits → (spec, backend)."""
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return {
        split: (changed, backend_with(changed))
        for split, changed in ((True, spec), (False, without_digit_splitting(spec)))
    }


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
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(prose, min_size=1, max_size=4), st.booleans())
def test_prose_encodes_exactly_as_the_tokenizer(smollm2_backends, texts, split_digits):
    spec, backend = smollm2_backends[split_digits]
    encoder = PieceEncoder.for_spec(backend, spec)
    for text in texts + texts:  # the second round comes from the word cache
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids


# Where a space is not where a piece starts, or ends a digit-free part (digits split first): the regex path.
@pytest.mark.parametrize(
    "text",
    [
        "a\n 1",
        "a\n\n 12 b",
        "x \n",
        "foo ",
        " foo",
        "a  b",
        "a   b",
        "a\t b",
        "1 2",
        "it 's",
        "don't stop",
        "x \x1c y",
        "end\x1c 5",
        "q\x0c 9",
        "\n 3",
    ],
)
@pytest.mark.parametrize("split_digits", [True, False])
def test_word_boundaries_that_are_not_piece_boundaries(smollm2_backends, text, split_digits):
    spec, backend = smollm2_backends[split_digits]
    encoder = PieceEncoder.for_spec(backend, spec)
    for _ in range(2):
        assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids


def test_words_are_cached_only_with_non_whitespace_at_both_ends(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    text = "say hello world\n again 7x"
    assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids
    assert sorted(encoder._words.young) == [
        "7x",
        "again",
        "hello",
    ]  # not "world\n" (its end sees the next word)
    assert (
        encoder._words.young["7x"]
        == array("I", backend.encode(" 7x", add_special_tokens=False).ids).tobytes()
    )


def test_a_texts_first_word_is_cached_so_known_text_takes_no_regex_path(tiny_spec, monkeypatch):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    text = "user\nsay hello again"
    expected = backend.encode(text, add_special_tokens=False).ids
    assert encoder.encode(text).tolist() == expected
    assert encoder._heads.young == {"user\nsay": array("I", backend.encode("user\nsay").ids).tobytes()}
    monkeypatch.setattr(encoder, "_encode_pieces", None)  # the regex path is not taken again
    assert encoder.encode(text).tolist() == expected
    assert encoder.encode("user\nsay").tolist() == backend.encode("user\nsay", add_special_tokens=False).ids


def test_each_piece_is_tokenized_once_and_digits_are_pieces_of_their_own(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    ids = encoder.encode("go go go 42").tolist()
    assert ids == backend.encode("go go go 42", add_special_tokens=False).ids
    assert encoder.cached_pieces == 5  # "go", " go", " ", "4", "2"


def test_warming_adds_the_vocabularys_ascii_pieces_each_as_the_tokenizer_splits_it(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder.for_spec(backend, tiny_spec)
    added = encoder.warm_from_vocabulary()
    vocab = backend.get_vocab(with_added_tokens=False)
    assert 0 < added == encoder.pinned_pieces < len(vocab)  # "Ġ…" words and plain pieces, not "1a" or "é"
    assert encoder.cached_pieces == 0  # pinned, not yet in the hot generations
    pieces = [(piece, array("I", ids).tolist()) for piece, ids in encoder._cache.pinned.items()]
    assert all(ids == backend.encode(piece, add_special_tokens=False).ids for piece, ids in pieces)
    assert (" the", [vocab["Ġthe"]]) in pieces
    assert not any(not piece.isascii() for piece, _ in pieces)


def test_a_warmed_encoder_promotes_only_the_words_a_text_uses(smollm2_backends):
    spec, backend = smollm2_backends[True]
    encoder = PieceEncoder.for_spec(backend, spec)
    assert encoder.warm_from_vocabulary() == encoder.pinned_pieces > 30_000
    text = "Say hello world, hello again"
    assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids
    # Pinned words move to the young generation as they are used; "world," is no vocabulary word: its two
    # pieces come from the pinned pieces, and the word is cached whole.
    assert sorted(encoder._words.young) == ["again", "hello", "world,"]
    assert sorted(encoder._cache.young) == [" world", ",", "Say"]
    assert encoder.encode(text).tolist() == backend.encode(text, add_special_tokens=False).ids


def test_the_piece_cache_is_bounded(tiny_spec):
    backend = backend_with(tiny_spec)
    encoder = PieceEncoder(backend, split_digits=True, max_pieces=8)
    words = [f" w{'x' * n}" for n in range(40)]
    for word in words:
        encoder.encode(word)
    assert encoder.cached_pieces <= 8
    assert (
        encoder.encode("".join(words)).tolist()
        == backend.encode("".join(words), add_special_tokens=False).ids
    )


def test_non_ascii_text_is_left_to_the_tokenizer(tiny_spec):
    encoder = PieceEncoder.for_spec(backend_with(tiny_spec), tiny_spec)
    assert encoder.encode("héllo") is None
    assert encoder.encode("").tolist() == []


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s.update(normalizer={"type": "NFC"}),
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(add_prefix_space=True),
        lambda s: s["pre_tokenizer"]["pretokenizers"][1].update(use_regex=False),
        lambda s: s["pre_tokenizer"]["pretokenizers"].__setitem__(
            0, {"type": "Digits", "individual_digits": False}
        ),
        lambda s: s.update(
            pre_tokenizer={
                "type": "Split",
                "pattern": {"Regex": "\\s+"},
                "behavior": "Isolated",
                "invert": False,
            }
        ),
        lambda s: s.update(
            pre_tokenizer={"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
        ),
        lambda s: s.update(pre_tokenizer=None),
        lambda s: s["model"].update(dropout=0.1),
    ],
)
def test_tokenizers_it_cannot_reproduce_are_refused(tiny_spec, change):
    spec = copy.deepcopy(tiny_spec)
    change(spec)
    assert PieceEncoder.for_spec(None, spec) is None
