"""The character bound on a prompt's token count (``kvpilot.engine.prompt_bound``): exact for the bundled
tokenizers, sound on arbitrary text, and refused (None) for every tokenizer shape that can make one token of
an unbounded run of characters."""

from __future__ import annotations

import unicodedata
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvpilot.engine.prompt_bound import COMPOSED_MAX, max_chars_per_token, min_tokens
from kvpilot.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tiny(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


def bpe(vocab: dict[str, int], **model: object) -> BackendTokenizer:
    return BackendTokenizer(models.BPE(vocab, [], **model))


def wrap(backend: BackendTokenizer) -> Tokenizer:
    return Tokenizer(backend, {}, None)


def test_the_bound_is_the_longest_vocabulary_string(tiny: Tokenizer) -> None:
    assert max_chars_per_token(tiny) == len("<|endoftext|>") == 13  # an added token is the longest


@pytest.mark.slow
def test_smollm2s_bound_is_its_longest_whitespace_token(smollm2_dir: Path) -> None:
    # "\n" and 80 spaces, in byte-level spelling: 81 bytes
    assert max_chars_per_token(Tokenizer.from_dir(smollm2_dir)) == 81


@settings(max_examples=300, deadline=None)
@given(
    st.text(min_size=1, max_size=400)
    | st.lists(st.sampled_from(["<|im_start|>", "agmentation", " ", "a"]), min_size=1, max_size=200).map(
        "".join
    )
)
def test_no_text_encodes_to_fewer_tokens_than_the_bound(tiny: Tokenizer, text: str) -> None:
    per_token = max_chars_per_token(tiny)
    assert per_token is not None
    assert len(tiny.encode(text, add_special_tokens=False)) >= min_tokens(len(text), per_token)


def test_min_tokens_rounds_up() -> None:
    assert [min_tokens(n, 13) for n in (0, 1, 13, 14, 6643, 6644)] == [0, 1, 1, 2, 511, 512]


def test_composition_merges_at_most_composed_max_characters_into_one() -> None:
    longest = max(
        len(unicodedata.normalize("NFD", chr(c))) for c in range(0x110000) if not 0xD800 <= c < 0xE000
    )
    assert longest == COMPOSED_MAX == 4


def test_composing_and_shrinking_normalizers_scale_the_bound() -> None:
    backend = bpe({"a": 0, "bb": 1, " ": 2})
    assert max_chars_per_token(wrap(backend)) == 2
    backend.normalizer = normalizers.NFC()
    assert max_chars_per_token(wrap(backend)) == 2 * COMPOSED_MAX
    backend.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace("   ", " ")])
    assert max_chars_per_token(wrap(backend)) == 2 * COMPOSED_MAX * 3
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("a"), normalizers.Lowercase()])
    assert max_chars_per_token(wrap(backend)) == 2


def test_a_composed_text_still_encodes_to_at_least_the_bound() -> None:
    backend = bpe({"\u1faf": 0})  # one code point, composed from four under NFC
    backend.normalizer = normalizers.NFC()
    text = unicodedata.normalize("NFD", "\u1faf") * 10
    per_token = max_chars_per_token(wrap(backend))
    assert (len(text), per_token, len(backend.encode(text).ids)) == (40, 4, 10)
    assert len(backend.encode(text).ids) >= min_tokens(len(text), per_token)


def dropping_normalizer() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.normalizer = normalizers.Sequence([normalizers.NFC(), normalizers.Strip()])
    return backend


def regex_replace() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.normalizer = normalizers.Replace(Regex("a+"), "a")
    return backend


def whitespace_split() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(), pre_tokenizers.WhitespaceSplit()]
    )
    return backend


def removing_split() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.pre_tokenizer = pre_tokenizers.Split(" ", "removed")
    return backend


def stripping_added_token() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.add_special_tokens([AddedToken("<mask>", lstrip=True)])
    return backend


def truncating() -> BackendTokenizer:
    backend = bpe({"a": 0})
    backend.enable_truncation(8)
    return backend


@pytest.mark.parametrize(
    "make",
    [
        lambda: bpe(
            {"a": 0, "<unk>": 1}, unk_token="<unk>", fuse_unk=True
        ),  # one <unk> for a run of unknowns
        lambda: BackendTokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),  # a whole word
        lambda: BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")),
        lambda: BackendTokenizer(models.Unigram([("a", 0.0), ("<unk>", 0.0)], 1, byte_fallback=False)),
        dropping_normalizer,
        regex_replace,
        whitespace_split,
        removing_split,
        stripping_added_token,
        truncating,
    ],
    ids=[
        "fused-unk",
        "wordpiece",
        "wordlevel",
        "unigram",
        "strip",
        "regex-replace",
        "whitespace-split",
        "removing-split",
        "lstrip-added-token",
        "truncation",
    ],
)
def test_tokenizers_that_can_swallow_a_run_have_no_bound(make) -> None:
    assert max_chars_per_token(wrap(make())) is None


def test_fallbacks_to_bytes_keep_the_bound() -> None:
    assert (
        max_chars_per_token(
            wrap(bpe({"a": 0, "<unk>": 1, "<0x41>": 2}, unk_token="<unk>", fuse_unk=True, byte_fallback=True))
        )
        == 6
    )
    unigram = BackendTokenizer(models.Unigram([("abc", 0.0), ("<unk>", 0.0)], 1, byte_fallback=True))
    assert max_chars_per_token(wrap(unigram)) == 5
