"""Incremental detokenization (multi-byte UTF-8) and stop strings in streams
(docs/architecture.md#stop-conditions-and-streaming)."""

from __future__ import annotations

import random

import pytest

from kvpilot.engine import detokenizer
from kvpilot.engine.detokenizer import REPLACEMENT, IncrementalDetokenizer, StopStringBuffer
from kvpilot.engine.tokenizer import Tokenizer

TEXTS = [
    "héllo wörld",
    "日本語のテキスト",
    "emoji 🚀🎉 mixed ✓",
    "plain ascii text, with punctuation!",
    "Ωmega → ∞ and ½",
]


@pytest.fixture(scope="module")
def tiny_tok(tiny_model_dir):
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_never_shows_a_replacement_character_the_text_lacks(tiny_tok, text):
    ids = tiny_tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level pieces: multi-byte characters span several tokens
    detok = IncrementalDetokenizer(tiny_tok, tiny_tok.encode("prompt: ", add_special_tokens=False))
    deltas = [detok.push(t) for t in ids]
    deltas.append(detok.flush())
    assert all(REPLACEMENT not in d for d in deltas)
    assert "".join(deltas) == text
    assert sum(1 for d in deltas if d) < len(ids) or len(text.encode()) == len(text)  # some tokens waited


def test_incomplete_character_at_the_end_is_flushed_as_decoded(tiny_tok):
    ids = tiny_tok.encode("ok 日", add_special_tokens=False)
    detok = IncrementalDetokenizer(tiny_tok, [])
    text = "".join(detok.push(t) for t in ids[:-1])
    assert text == "ok "  # the CJK character's first bytes are held
    # the sequence really ends mid-character: flushing yields what a full decode of it shows
    assert detok.flush() == tiny_tok.decode(ids[:-1])[len("ok ") :] == REPLACEMENT


def test_special_tokens_are_skipped_unless_asked(tiny_tok):
    ids = tiny_tok.encode("hi<|im_end|>", add_special_tokens=False)
    assert "".join(IncrementalDetokenizer(tiny_tok, [], True).push(t) for t in ids) == "hi"
    assert "".join(IncrementalDetokenizer(tiny_tok, [], False).push(t) for t in ids) == "hi<|im_end|>"


def test_stop_string_split_across_three_chunks_is_caught_without_leaking():
    buf = StopStringBuffer(["STOP"])
    shown = []
    for chunk in ["ab", "cS", "TO", "P!"]:
        buf.push(chunk)
        shown.append(buf.released)
    assert shown == ["ab", "abc", "abc", "abc"]
    assert buf.matched == "STOP" and buf.flush() == "abc"


def test_no_match_is_fully_recovered_by_flush():
    buf = StopStringBuffer(["STOP", "END"])
    for chunk in ["xS", "T", "Ox", "E", "N"]:
        buf.push(chunk)
        assert not buf.released.endswith(("S", "ST", "E", "EN"))  # possible starts are held back
    assert buf.flush() == "xSTOxEN"


def test_include_stop_string_and_earliest_match_wins():
    buf = StopStringBuffer(["world", "lo w"], include_stop=True)
    buf.push("hello world")
    assert buf.matched == "lo w" and buf.released == "hello w"


def test_random_tokens_stream_to_exactly_their_full_decode(tiny_tok):
    """Byte-level pieces in any order, many ending inside a character: the deltas plus the flush are the
    full decode, and a prompt that ends mid-character leaves no fragment of it in the output."""
    rng = random.Random(0)
    vocab = tiny_tok.vocab_size
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 24))]
        detok = IncrementalDetokenizer(tiny_tok, [])
        assert "".join(detok.push(t) for t in ids) + detok.flush() == tiny_tok.decode(ids)
    split = tiny_tok.encode("日", add_special_tokens=False)
    assert len(split) > 1  # the character spans tokens: a prompt of its first ones ends inside it
    detok = IncrementalDetokenizer(tiny_tok, tiny_tok.encode("ok ", add_special_tokens=False) + split[:1])
    ids = tiny_tok.encode("done", add_special_tokens=False)
    assert "".join(detok.push(t) for t in ids) + detok.flush() == "done"


def test_a_stream_whose_window_stops_extending_restarts_without_losing_text(tiny_tok, monkeypatch):
    """``DecodeStream.step`` raises "Invalid prefix" when a window's decode stops extending the previous
    one (seen with some decoders); the detokenizer restarts the stream from recent tokens and the text
    comes out whole."""
    text = "héllo wörld, again"
    ids = tiny_tok.encode(text, add_special_tokens=False)
    calls = {"n": 0}

    class FlakyStream:
        def __init__(self, skip_special_tokens):
            self.inner = real_stream(skip_special_tokens=skip_special_tokens)

        def step(self, tokenizer, token_id):
            calls["n"] += 1
            if calls["n"] == 9:
                raise Exception("Invalid prefix encountered")  # what tokenizers raises
            return self.inner.step(tokenizer, token_id)

    real_stream = detokenizer.DecodeStream
    monkeypatch.setattr(detokenizer, "DecodeStream", FlakyStream)
    detok = IncrementalDetokenizer(tiny_tok, [])
    assert "".join(detok.push(t) for t in ids) + detok.flush() == text
    assert calls["n"] > 9  # the failure happened mid-stream


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_completed_by_the_final_flush_is_reported(include):
    """The last token ends inside a UTF-8 character, so its text waits in the detokenizer until the finish;
    a stop string it completes there cut the text but the output said finish "length", no stop_reason."""
    from kvpilot.engine import LLM, SamplingParams

    llm = LLM("tiny-random", device="cpu", num_kv_blocks=32)
    tok = llm.get_tokenizer()
    partial = next(t for t in range(3, 512) if tok.decode([t]) == REPLACEMENT)  # a lone lead byte
    params = SamplingParams(
        temperature=0,
        max_tokens=2,
        logit_bias={partial: 100},
        stop=[REPLACEMENT],
        include_stop_str_in_output=include,
    )
    (out,) = llm.generate([[5, 6, 7]], params)[0].outputs
    assert (out.text, out.finish_reason, out.stop_reason) == (
        REPLACEMENT if include else "",
        "stop",
        REPLACEMENT,
    )
    (record,) = llm.engine.terminal_records
    assert record.finish_reason == "stop"
