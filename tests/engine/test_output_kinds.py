"""``output_kind`` (vLLM's ``RequestOutputKind``): ``delta`` outputs hold only what is new, and joined they
are the ``cumulative`` run's final output (tokens, text held back around a stop string, logprobs, each
sample's finish once); ``final_only`` gives one output per request; ``LLM.generate`` returns the same
outputs whatever the kind."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sampling.params import SamplingParamsError

PROMPT = [5, 6, 7, 8, 9, 10]


def params(kind: str, **kw) -> SamplingParams:
    base = {"temperature": 1.0, "seed": 7, "max_tokens": 24, "n": 2, "logprobs": 1}
    return SamplingParams(output_kind=kind, **(base | kw))


def step_outputs(llm: LLM, p: SamplingParams) -> list:
    llm.engine.add_request("r", PROMPT, p)
    outs = []
    while llm.engine.has_unfinished_requests():
        outs.extend(o for o in llm.engine.step() if o.request_id == "r")
    return outs


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), block_size=4, num_kv_blocks=64)


def stop_string(llm: LLM) -> str:
    """A stop string the seeded run produces mid-way (so text is held back and cut)."""
    (final,) = llm.generate([PROMPT], params("cumulative", n=1))
    text = final.outputs[0].text
    assert len(text) > 8
    return text[len(text) // 2 : len(text) // 2 + 2]


@pytest.mark.parametrize("with_stop", [False, True])
def test_deltas_joined_are_the_cumulative_output(llm, with_stop):
    stop = [stop_string(llm)] if with_stop else []
    cumulative = step_outputs(llm, params("cumulative", stop=stop))
    deltas = step_outputs(llm, params("delta", stop=stop))
    assert len(deltas) > 2 and all(len(c.token_ids) <= 1 for o in deltas for c in o.outputs)
    final = {c.index: c for c in cumulative[-1].outputs}
    for index, expected in final.items():
        parts = [c for o in deltas for c in o.outputs if c.index == index]
        assert [t for c in parts for t in c.token_ids] == expected.token_ids
        assert "".join(c.text for c in parts) == expected.text
        assert [lp for c in parts for lp in c.logprobs] == expected.logprobs
        assert [c.finish_reason for c in parts if c.finish_reason] == [expected.finish_reason]
        assert parts[-1].cumulative_logprob == pytest.approx(expected.cumulative_logprob)
    if with_stop:  # the first sample (the seed stop_string ran) ends at it, the stop string cut off
        assert final[0].finish_reason == "stop" and stop[0] not in final[0].text


def test_final_only_is_one_output_at_the_end(llm):
    outs = step_outputs(llm, params("final_only"))
    assert len(outs) == 1 and outs[0].finished
    (cumulative,) = llm.generate([PROMPT], params("cumulative"))
    assert [c.token_ids for c in outs[0].outputs] == [c.token_ids for c in cumulative.outputs]


def test_generate_returns_the_same_outputs_whatever_the_kind(llm):
    runs = [
        llm.generate([PROMPT, PROMPT[:3]], params(kind)) for kind in ("cumulative", "delta", "final_only")
    ]
    first = [[(c.token_ids, c.text) for c in o.outputs] for o in runs[0]]
    for run in runs[1:]:
        assert [[(c.token_ids, c.text) for c in o.outputs] for o in run] == first


def test_an_unknown_kind_is_refused():
    with pytest.raises(SamplingParamsError, match="output_kind must be one of cumulative, delta, final_only"):
        SamplingParams(output_kind="stream")
