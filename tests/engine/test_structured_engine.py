"""Structured outputs through the engine on the tiny model, greedy and exact: constrained outputs satisfy
their grammar, the same prompt unconstrained does not (so each test can fail), and unconstrained rows of
a mixed batch come out as in a batch without constrained rows (docs/architecture.md#structured-outputs)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvpilot.engine.llm import LLM
from kvpilot.engine.request_validation import RequestError
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.structured.params import GuidedDecodingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "colour", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Describe the item as JSON:", "hello there", "x"]


@pytest.fixture(scope="module")
def llm(tiny_model_dir) -> LLM:
    return LLM(str(tiny_model_dir), num_kv_blocks=256)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=kw.pop("max_tokens", 400), **kw)


def texts(llm: LLM, prompts: list[str], params) -> list[str]:
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


def satisfies(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def test_json_schema_outputs_validate_and_end_with_stop(llm: LLM):
    outs = llm.generate(PROMPTS, greedy(structured_outputs=StructuredOutputsParams(json=SCHEMA)))
    for out in outs:
        assert satisfies(out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop"
    assert not any(satisfies(t) for t in texts(llm, PROMPTS, greedy()))  # the negative control


def test_json_object_regex_and_choice(llm: LLM):
    # a random model writes free JSON strings without end: the bias closes strings and objects early, and
    # the grammar keeps the result an object
    tok = llm.get_tokenizer()
    bias = {tok.encode(c, add_special_tokens=False)[0]: b for c, b in (("}", 8.0), ('"', 6.0))}
    objects = llm.generate(
        PROMPTS, greedy(guided_decoding=GuidedDecodingParams(json_object=True), logit_bias=bias)
    )
    assert all(o.outputs[0].finish_reason == "stop" for o in objects)
    assert all(isinstance(json.loads(o.outputs[0].text), dict) for o in objects)
    assert not any(t.startswith("{") for t in texts(llm, PROMPTS, greedy(max_tokens=8, logit_bias=bias)))
    pattern = r"[A-Z]{3}-[0-9]{2,4}"
    regex = texts(llm, PROMPTS, greedy(structured_outputs=StructuredOutputsParams(regex=pattern)))
    assert all(re.fullmatch(pattern, t) for t in regex), regex
    choices = ["alpha", "beta gamma", "δ"]
    chosen = texts(llm, PROMPTS, greedy(structured_outputs=StructuredOutputsParams(choice=choices)))
    assert all(t in choices for t in chosen), chosen
    free = texts(llm, PROMPTS, greedy(max_tokens=8))
    assert not any(re.fullmatch(pattern, t) or t in choices for t in free)


def test_parallel_samples_each_follow_the_grammar(llm: LLM):
    params = SamplingParams(
        n=3, temperature=1.0, seed=7, max_tokens=400, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    (out,) = llm.generate([PROMPTS[0]], params)
    samples = [c.text for c in out.outputs]
    assert len(samples) == 3 and all(satisfies(t) for t in samples), samples


def test_unconstrained_rows_are_unchanged_by_constrained_neighbours(llm: LLM):
    free = [greedy(max_tokens=12), SamplingParams(temperature=0.9, seed=3, max_tokens=12)]
    alone = texts(llm, PROMPTS[:2], free)
    constrained = greedy(structured_outputs=StructuredOutputsParams(json=SCHEMA))
    mixed = texts(llm, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [free[0], constrained, free[1]])
    assert [mixed[0], mixed[2]] == alone
    assert satisfies(mixed[1])


def test_the_engine_compiles_once_per_schema(llm: LLM):
    grammars = llm.engine.grammars
    spec = StructuredOutputsParams(json={**SCHEMA, "title": "cache probe"})
    misses, hits = grammars.misses, grammars.hits
    llm.generate(PROMPTS[:2], greedy(max_tokens=4, structured_outputs=spec))
    assert (grammars.misses - misses, grammars.hits - hits) == (1, 1)


def test_a_schema_that_does_not_compile_is_a_request_error(llm: LLM):
    bad = StructuredOutputsParams(json={"type": "array", "uniqueItems": True})
    with pytest.raises(RequestError, match="uniqueItems"):
        llm.engine.add_request("bad-schema", "hi", greedy(structured_outputs=bad))
    assert not llm.engine.has_unfinished_requests()
