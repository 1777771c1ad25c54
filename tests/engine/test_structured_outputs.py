"""The structured-outputs package on the tiny model's tokenizer: parameters, compile and its cache, the
matcher, and the bitmask kernel against plain references (docs/architecture.md#structured-outputs)."""

from __future__ import annotations

import json

import llguidance
import pytest
import torch

from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.params import SamplingParams, SamplingParamsError
from kvpilot.engine.sampling.sampler import Sampler
from kvpilot.engine.structured.bitmask import (
    GrammarMasks,
    apply_token_bitmask_,
    illegal_tokens,
    unpack_bitmask,
)
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.structured.grammar import GrammarError
from kvpilot.engine.structured.params import (
    GuidedDecodingParams,
    StructuredOutputsError,
    StructuredOutputsParams,
)
from kvpilot.engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


# ---- parameters ---------------------------------------------------------------------------------------
def test_exactly_one_constraint_and_its_key():
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputsError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(StructuredOutputsError) as err:
        StructuredOutputsParams(json="{not json")
    assert err.value.param == "json"
    with pytest.raises(StructuredOutputsError):
        StructuredOutputsParams(choice=[])
    # a schema as text or as an object is one grammar; key order is kept (it is the output's order)
    a = StructuredOutputsParams(json='{"type": "object", "properties": {"b": {}, "a": {}}}')
    b = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.key == b.key and a.text.index('"b"') < a.text.index('"a"')
    assert StructuredOutputsParams(choice=["x", "y"]).key == ("choice", '["x", "y"]', False)
    assert GuidedDecodingParams is StructuredOutputsParams


def test_sampling_params_take_structured_outputs_under_either_name():
    spec = StructuredOutputsParams(regex="[0-9]+")
    assert SamplingParams(guided_decoding=spec).structured_outputs is spec
    with pytest.raises(SamplingParamsError, match="one setting"):
        SamplingParams(structured_outputs=spec, guided_decoding=StructuredOutputsParams(regex="x"))
    with pytest.raises(SamplingParamsError, match="use_beam_search"):
        SamplingParams(structured_outputs=spec, use_beam_search=True, n=2, temperature=0)


# ---- compile ------------------------------------------------------------------------------------------
def test_compile_is_cached_by_kind_and_text(compiler: GrammarCompiler):
    hits, misses = compiler.hits, compiler.misses
    first = compiler.compile(StructuredOutputsParams(json=SCHEMA))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(SCHEMA)))
    assert again is first and first.result().kind == "json"
    assert (compiler.hits - hits, compiler.misses - misses) == (1, 1)
    compact = compiler.compile(StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True))
    assert compact is not first and compiler.misses - misses == 2


def test_unsupported_keyword_is_named(compiler: GrammarCompiler):
    with pytest.raises(GrammarError) as err:
        compiler.compile(StructuredOutputsParams(json={"type": "array", "uniqueItems": True})).result()
    assert err.value.keyword == "uniqueItems"
    with pytest.raises(GrammarError) as err:
        compiler.compile(StructuredOutputsParams(json={"type": "string", "format": "colour"})).result()
    assert err.value.keyword == "format"
    with pytest.raises(GrammarError, match="regex") as err:
        compiler.compile(StructuredOutputsParams(regex="((")).result()
    assert err.value.keyword is None


def test_a_failed_compile_is_cached_too(compiler: GrammarCompiler):
    spec = StructuredOutputsParams(json={"not": {"type": "null"}})
    assert compiler.compile(spec) is compiler.compile(spec)


# ---- matcher ------------------------------------------------------------------------------------------
def test_matcher_walks_a_document_to_its_end(compiler: GrammarCompiler, tokenizer: Tokenizer):
    m = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    doc = ids(tokenizer, '{"n": 7, "ok": true}')
    for t in doc[:-1]:
        assert m.accept(t) and not m.is_finished
    assert m.accept(doc[-1]) and m.is_finished and m.error is None


def test_forks_advance_independently(compiler: GrammarCompiler, tokenizer: Tokenizer):
    parent = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    child = parent.fork()
    assert all(child.accept(t) for t in ids(tokenizer, "no")) and child.is_finished
    assert not parent.is_finished and all(parent.accept(t) for t in ids(tokenizer, "yes"))


def test_a_forbidden_token_puts_the_matcher_in_error(compiler: GrammarCompiler, tokenizer: Tokenizer):
    m = compiler.matcher(StructuredOutputsParams(choice=["yes", "no"]))
    assert not m.accept(ids(tokenizer, "x")[0])
    assert m.error


# ---- bitmask ------------------------------------------------------------------------------------------
def reference_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Token by token: bit t % 32 of word t // 32 clear → −inf."""
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (int(bitmask[j, t // 32]) >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [32, 70, 512])
def test_bitmask_kernel_equals_the_reference(vocab: int):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    words = (vocab + 31) // 32
    bitmask = torch.randint(-(1 << 31), (1 << 31) - 1, (3, words), dtype=torch.int32, generator=gen)
    rows = [0, 2, 4]
    ours = logits.clone()
    apply_token_bitmask_(ours, bitmask, torch.tensor(rows))
    assert torch.equal(ours, reference_apply(logits, bitmask, rows))
    untouched = [1, 3]
    assert torch.equal(ours[untouched], logits[untouched])
    every = logits[:3].clone()
    apply_token_bitmask_(every, bitmask, None)
    assert torch.equal(every, reference_apply(logits[:3], bitmask, [0, 1, 2]))


@pytest.mark.parametrize("vocab", [1, 33, 49152])
def test_the_cpu_unpacking_equals_the_device_one(vocab: int):
    """The CPU path (numpy's unpackbits over the words' bytes) and the GPU path (shifts on the device),
    run here on the CPU, agree bit for bit."""
    gen = torch.Generator().manual_seed(vocab)
    bitmask = torch.randint(
        -(1 << 31), (1 << 31) - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=gen
    )
    assert torch.equal(illegal_tokens(bitmask, vocab, torch.device("cpu")), ~unpack_bitmask(bitmask, vocab))


def test_filled_masks_are_llguidance_own_allowed_sets(compiler: GrammarCompiler, tokenizer: Tokenizer):
    """At each place of a walk the batched fill equals llguidance's byte-per-token mask (an independent
    path through the library) for every matcher of the batch."""
    vocab = tokenizer.vocab_size
    json_m = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
    regex_m = compiler.matcher(StructuredOutputsParams(regex="[a-c]{2,3}"))
    masks = GrammarMasks(threads=1)
    json_walk, regex_walk = ids(tokenizer, '{"n": 42'), ids(tokenizer, "abc")
    assert len(json_walk) > len(regex_walk)
    for step, json_t in enumerate(json_walk):
        regex_t = regex_walk[step] if step < len(regex_walk) else None
        bitmask = masks.fill([json_m, regex_m], vocab)
        legal = unpack_bitmask(bitmask, vocab)
        for row, m in enumerate((json_m, regex_m)):
            expected = torch.frombuffer(bytearray(m.ll.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
            assert torch.equal(legal[row], expected)
        assert legal[0, json_t]
        json_m.accept(json_t)
        if regex_t is not None:
            assert legal[1, regex_t]
            regex_m.accept(regex_t)
    assert legal[1].nonzero().flatten().tolist() == sorted(tokenizer.eos_token_ids)  # "abc": only EOS


def test_grammar_masks_apply_to_the_listed_rows_and_count_them(compiler: GrammarCompiler, tokenizer):
    vocab = tokenizer.vocab_size
    m = compiler.matcher(StructuredOutputsParams(choice=["ab"]))
    masks = GrammarMasks(threads=1)
    logits = torch.zeros(3, vocab)
    masks.apply(logits, [1], [m])
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ids(tokenizer, "ab")[0]]
    assert torch.equal(logits[[0, 2]], torch.zeros(2, vocab))
    assert masks.rows == 1 and masks.seconds > 0
    assert isinstance(m.ll, llguidance.LLMatcher)


# ---- the sampler's constraint stage ---------------------------------------------------------------------
def test_the_mask_composes_with_bias_bad_words_and_penalties(compiler: GrammarCompiler, tokenizer: Tokenizer):
    """The grammar masks first; bias, bad words and penalties then act on what it left."""
    vocab = tokenizer.vocab_size
    a, b, c = (ids(tokenizer, x)[0] for x in "abc")
    spec = StructuredOutputsParams(regex="[abc]")
    params = SamplingParams(temperature=0, logit_bias={b: 5.0, 7: 50.0}, repetition_penalty=2.0)
    logits = torch.zeros(1, vocab)
    logits[0, c] = 3.0
    state = RowState(params, [c], [], frozenset(), [[a]], {}, grammar=compiler.matcher(spec))
    out = Sampler(torch.Generator().manual_seed(0)).sample(logits.clone(), [state], want_full=[True])
    full = out.full_logprobs[0]
    assert torch.isfinite(full).nonzero().flatten().tolist() == sorted([b, c])  # a banned, 7 not in grammar
    assert out.token_ids == [b]  # b: 0 + 5 bias beats c: 3 / 2 (repetition, c is in the prompt)


def test_unconstrained_rows_sample_as_if_alone(compiler: GrammarCompiler, tokenizer: Tokenizer):
    vocab = tokenizer.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(3))
    free = [SamplingParams(temperature=0), SamplingParams(temperature=0.8, seed=5)]

    def rows(with_grammar: bool) -> list[RowState]:
        out = [
            RowState(p, [1], [], generator=torch.Generator().manual_seed(11 + i)) for i, p in enumerate(free)
        ]
        if with_grammar:
            m = compiler.matcher(StructuredOutputsParams(json=SCHEMA))
            out.insert(1, RowState(SamplingParams(temperature=0), [1], [], grammar=m))
        return out

    alone = Sampler(torch.Generator().manual_seed(0)).sample(logits[[0, 2]], rows(False))
    mixed = Sampler(torch.Generator().manual_seed(0)).sample(logits[[0, 1, 2]], rows(True))
    assert [mixed.token_ids[0], mixed.token_ids[2]] == alone.token_ids
    assert mixed.token_ids[1] == ids(tokenizer, "{")[0]  # the grammar's only legal first token
