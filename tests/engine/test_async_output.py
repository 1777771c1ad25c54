"""Asynchronous output processing (``TokenAppender.defer_detokenize``, on by default on CUDA): a token's
text and stop strings are processed in the next step, while the device runs that step's forward. The
outputs must be the synchronous path's exactly — text, token ids, finish and stop reasons, logprobs,
streamed deltas — and a stop string found one step late costs one extra computed row, never a token.
Forced on here, on CPU."""

from __future__ import annotations

import pytest

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.sequence import SequenceStatus

ENGINE = {
    "model": "tiny-random",
    "device": "cpu",
    "dtype": "float32",
    "max_num_seqs": 8,
    "num_kv_blocks": 96,
    "max_num_batched_tokens": 64,
}
PROMPTS = [[(13 * i + 5 * j) % 200 + 20 for j in range(5 + 3 * i)] for i in range(6)]


def _llm(defer: bool) -> LLM:
    llm = LLM(**ENGINE)
    llm.engine.output_processor.appender.defer_detokenize = defer
    return llm


def _stop_strings() -> list[list[str]]:
    """A stop string from the middle of each prompt's greedy text (so that most of them match)."""
    texts = [
        o.outputs[0].text for o in _llm(False).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0))
    ]
    return [[t[len(t) // 2 : len(t) // 2 + 3]] if len(t) > 6 else [] for t in texts]


def _params(stops: list[list[str]]) -> list[SamplingParams]:
    common = {"max_tokens": 16, "logprobs": 2}
    params = [SamplingParams(temperature=0.0, stop=s, **common) for s in stops]
    params[1] = SamplingParams(temperature=0.9, seed=7, n=2, stop=stops[1], **common)
    params[2] = SamplingParams(temperature=0.8, seed=3, n=2, best_of=3, stop=stops[2], **common)
    params[3] = SamplingParams(temperature=0.0, stop=stops[3], include_stop_str_in_output=True, **common)
    return params


def _final(outputs) -> list:
    return [
        [
            (c.text, c.token_ids, c.finish_reason, c.stop_reason, c.cumulative_logprob, _logprobs(c))
            for c in o.outputs
        ]
        for o in outputs
    ]


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [{t: round(lp.logprob, 6) for t, lp in entry.items()} for entry in completion.logprobs]


def test_deferred_text_and_stop_strings_give_the_synchronous_outputs():
    stops = _stop_strings()
    sync = _llm(False)
    want = sync.generate(PROMPTS, _params(stops))
    deferred = _llm(True)
    got = deferred.generate(PROMPTS, _params(stops))
    deferred.engine.check_invariants()
    assert _final(got) == _final(want)
    reasons = [c.stop_reason for o in want for c in o.outputs]
    assert sum(isinstance(r, str) for r in reasons) >= 3  # stop strings did end requests
    assert deferred.engine.output_processor.appender.num_deferred_tokens > 0
    assert sync.engine.output_processor.appender.num_deferred_tokens == 0
    # each stop string was found a step late: its sequence computed one more row, and appended nothing more
    assert deferred.engine.stats.generation_tokens == sync.engine.stats.generation_tokens
    records = deferred.engine.terminal_records
    assert sorted(r.request_id for r in records) == sorted({r.request_id for r in records})


def _streamed(
    defer: bool, stops: list[list[str]], abort_at: int | None = None, registry: bool = False
) -> dict[str, tuple]:
    """Each request's text, token ids and logprobs as its delta outputs add up, stepping the engine by
    hand; with ``abort_at``, request ``r0`` is cancelled after that many steps (through the registry
    directly with ``registry``: no flush of the deferred tokens first)."""
    engine = _llm(defer).engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(stops), strict=True)):
        params.output_kind = "delta"
        if params.best_of is None:
            engine.add_request(f"r{i}", prompt, params)
    texts: dict[str, tuple] = {}
    steps = 0
    while engine.has_unfinished_requests():
        _add_deltas(texts, engine.step())
        steps += 1
        if steps == abort_at:
            abort = engine.registry.abort if registry else engine.abort_request
            assert abort("r0", SequenceStatus.CANCELLED)
            _add_deltas(texts, engine.step())  # the cancelled request's last delta
        engine.check_invariants()
    assert len(engine.terminal_records) == len({r.request_id for r in engine.terminal_records})
    return texts


def _add_deltas(streams: dict[str, tuple], outputs) -> None:
    ids = [out.request_id for out in outputs]
    assert len(ids) == len(set(ids))  # a step gives at most one output per request
    for out in outputs:
        for c in out.outputs:
            assert len(c.logprobs) == len(c.token_ids)  # a delta's tokens and their logprobs, together
            text, tokens, logprobs = streams.get(f"{out.request_id}/{c.index}", ("", [], []))
            streams[f"{out.request_id}/{c.index}"] = (
                text + c.text,
                tokens + c.token_ids,
                logprobs + _logprobs(c),
            )


def test_streamed_deltas_add_up_to_the_synchronous_text():
    stops = _stop_strings()
    assert _streamed(True, stops) == _streamed(False, stops)


@pytest.mark.parametrize("abort_at, registry", [(3, False), (6, False), (3, True)])
def test_a_cancel_between_steps_keeps_every_appended_tokens_text(abort_at, registry):
    stops = _stop_strings()
    assert _streamed(True, stops, abort_at, registry) == _streamed(False, stops, abort_at, registry)


def test_a_cancel_leaves_other_requests_deferred_stops_to_a_step():
    """Cancelling A outside a step must not end B there: the server steps only while requests are
    unfinished, so a final output B got outside a step would never be delivered. B's stop string is
    deferred at the step where the synchronous engine ends it; A is cancelled right after."""
    prompt_b = [20 + (5 * j) % 200 for j in range(8)]
    prompt_a = [33 + (7 * j) % 200 for j in range(6)]
    text = _llm(False).generate([prompt_b], SamplingParams(max_tokens=16, temperature=0))[0].outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]

    def engine(defer: bool):
        eng = _llm(defer).engine
        eng.add_request("B", prompt_b, SamplingParams(max_tokens=16, temperature=0, stop=[stop]))
        eng.add_request("A", prompt_a, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
        return eng

    sync, steps = engine(False), 0
    while not any(o.request_id == "B" and o.finished for o in sync.step()):
        steps += 1
    finals = {}
    for defer in (False, True):
        eng, delivered = engine(defer), []
        for _ in range(steps + 1):
            delivered += [o for o in eng.step() if o.finished]
        eng.abort_request("A", SequenceStatus.CANCELLED)
        while eng.has_unfinished_requests():  # the server loop's rule
            delivered += [o for o in eng.step() if o.finished]
        # (the server answers a cancelled request itself: A's own final output is not needed)
        finals[defer] = [
            (o.outputs[0].text, o.outputs[0].finish_reason) for o in delivered if o.request_id == "B"
        ]
    assert len(finals[False]) == 1 and finals[False][0][1] == "stop"
    assert finals[True] == finals[False]  # deferred: delivered in the step after the cancel


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_under_deferral_give_the_synchronous_outputs(mode):
    """A cache too small for the batch: sequences are preempted (recomputed or swapped) while tokens of
    theirs are deferred; the outputs still equal the synchronous engine's."""
    engine = {
        **ENGINE,
        "num_kv_blocks": 14,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "preemption_mode": mode,
        "swap_space": 0.01 if mode == "swap" else 0.0,
    }
    prompts = [[(13 * i + 5 * j) % 200 + 20 for j in range(5 + 2 * i)] for i in range(6)]
    greedy = SamplingParams(max_tokens=12, temperature=0)
    texts = [o.outputs[0].text for o in LLM(**engine).generate(prompts, greedy)]
    stops = [[t[len(t) // 2 : len(t) // 2 + 2]] if len(t) > 6 else [] for t in texts]
    params = [SamplingParams(max_tokens=12, temperature=0.0, stop=s, logprobs=1) for s in stops]
    params[1] = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, stop=stops[1], logprobs=1)
    results = {}
    for defer in (False, True):
        llm = LLM(**engine)
        llm.engine.output_processor.appender.defer_detokenize = defer
        outputs = llm.generate(prompts, params)
        llm.engine.check_invariants()
        assert llm.engine.stats.preemptions > 0  # the scenario really preempts
        if defer:
            assert llm.engine.output_processor.appender.num_deferred_tokens > 0
        results[defer] = _final(outputs)
    # the schedules differ (a deferred stop holds its blocks a step longer), so the rows a recompute
    # shares a batch with differ too: tokens, text and ends exactly, scores to float rounding
    for got, want in zip(results[True], results[False], strict=True):
        assert [c[:4] for c in got] == [c[:4] for c in want]
        assert [c[4] for c in got] == pytest.approx([c[4] for c in want], abs=1e-4)
    assert any(c[2] == "stop" for o in results[True] for c in o)  # stop strings among the ends
