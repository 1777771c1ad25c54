"""Asynchronous scheduling (``async_scheduling``, docs/architecture.md#asynchronous-scheduling): each step is
scheduled and launched before the host has the last step's sampled tokens, its inputs copied from them on
the device, and the host appends them (stop checks included) while the step computes. Its outputs must be
the synchronous engine's exactly — tokens, text, finish and stop reasons, streamed deltas, logprobs of the
steps that still sample synchronously — and a sequence that stops costs at most one computed row more,
never a token. Greedy and seeded requests only: an unseeded draw depends on the batch it shares. On the
test device (``KVPILOT_TEST_DEVICE=cuda``: the pinned copy and its event, and decode graphs)."""

from __future__ import annotations

import pytest
from engine_device import ENGINE_DEVICE

from kvpilot.engine import LLM, SamplingParams
from kvpilot.engine.config import ConfigError
from kvpilot.engine.engine_args import EngineArgs
from kvpilot.engine.sequence import SequenceStatus
from kvpilot.engine.structured.params import StructuredOutputsParams

ENGINE = {
    "model": "tiny-random",
    **ENGINE_DEVICE,
    "max_num_seqs": 8,
    "num_kv_blocks": 96,
    "max_num_batched_tokens": 64,
}
PROMPTS = [[(13 * i + 5 * j) % 200 + 20 for j in range(5 + 3 * i)] for i in range(9)]


def _llm(asynchronous: bool, **overrides) -> LLM:
    return LLM(**{**ENGINE, **overrides}, async_scheduling=asynchronous)


def _greedy_texts() -> list[str]:
    outs = _llm(False).generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _params() -> list[SamplingParams]:
    """Every way a sequence ends or is shaped, one per prompt: a stop string, a stop token, max_tokens,
    parallel samples (forked when the prompt finishes), best_of, penalties, min_tokens; logprobs and beams,
    whose rows sample synchronously beside the ones in flight."""
    texts = _greedy_texts()
    greedy_tokens = _llm(False).generate(PROMPTS[5], SamplingParams(max_tokens=8, temperature=0))
    stop_token = greedy_tokens[0].outputs[0].token_ids[4]
    common = {"max_tokens": 16}
    return [
        SamplingParams(temperature=0, stop=[texts[0][len(texts[0]) // 2 :][:3]], **common),
        SamplingParams(temperature=0.9, seed=7, n=3, **common),
        SamplingParams(temperature=0.8, seed=3, n=2, best_of=3, **common),
        SamplingParams(temperature=0, stop=[texts[3][6:9]], include_stop_str_in_output=True, **common),
        SamplingParams(temperature=0.7, seed=11, top_k=20, top_p=0.9, repetition_penalty=1.3, **common),
        SamplingParams(temperature=0, stop_token_ids=[stop_token], **common),
        SamplingParams(temperature=0, min_tokens=5, frequency_penalty=0.5, max_tokens=9),
        SamplingParams(temperature=0.6, seed=2, logprobs=2, **common),
        SamplingParams(temperature=0, use_beam_search=True, beam_width=3, n=2, max_tokens=8),
    ]


def _final(outputs) -> list:
    return [
        [(c.text, c.token_ids, c.finish_reason, c.stop_reason, _logprobs(c)) for c in o.outputs]
        for o in outputs
    ]


def _logprobs(completion) -> list | None:
    if completion.logprobs is None:
        return None
    return [{t: round(lp.logprob, 5) for t, lp in entry.items()} for entry in completion.logprobs]


def test_outputs_equal_the_synchronous_engines():
    params = _params()
    sync, asynchronous = _llm(False), _llm(True)
    want = _final(sync.generate(PROMPTS, params))
    got = _final(asynchronous.generate(PROMPTS, params))
    asynchronous.engine.check_invariants()
    assert got == want
    ends = [c[2:4] for o in want for c in o]  # a stop string, a stop token and max_tokens ended them
    assert any(isinstance(r, str) for _, r in ends) and ("length", None) in ends
    assert ("stop", params[5].stop_token_ids[0]) in ends
    # a stop found on the host one step late computed a row more, and appended nothing more
    assert asynchronous.engine.stats.generation_tokens == sync.engine.stats.generation_tokens
    assert asynchronous.engine.output_processor.num_in_flight_steps > 0
    assert sync.engine.output_processor.num_in_flight_steps == 0
    records = asynchronous.engine.terminal_records
    assert sorted(r.request_id for r in records) == sorted({r.request_id for r in records})


def test_a_token_in_flight_that_ends_its_sequence_is_not_computed_again():
    """max_tokens = 6: six forward steps in both modes. The sixth token is still in flight when the
    asynchronous engine schedules again; it is the last, so that tick computes nothing."""
    steps = {}
    for asynchronous in (False, True):
        engine = _llm(asynchronous).engine
        engine.add_request("r", PROMPTS[2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        steps[asynchronous] = engine.num_steps
        assert outputs[-1].finished and len(outputs[-1].outputs[0].token_ids) == 6
    assert steps == {False: 6, True: 6}


def test_a_request_paused_while_its_stop_token_is_in_flight_finishes():
    """A slow stream reader pauses a request after the step that sampled its stop token. Asynchronously
    that token is still in flight when the next tick moves the paused sequence to BACKPRESSURED; the stop
    found then ends it as the synchronous engine ends it (it raised IllegalTransition, failing the engine)."""
    probe = _llm(False).generate(PROMPTS[4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    tokens = probe[0].outputs[0].token_ids
    last = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # first stop: at index last
    ends = {}
    for asynchronous in (False, True):
        engine = _llm(asynchronous).engine
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, stop_token_ids=[tokens[last]])
        engine.add_request("r", PROMPTS[4], params)
        outputs = []
        for _ in range(last + 1):  # the stop token sampled (synchronously: appended and finished)
            outputs += engine.step()
        engine.set_backpressure("r", True)
        for _ in range(3):
            outputs += engine.step()
        engine.check_invariants()
        assert not engine.has_unfinished_requests() and not engine.kv.sequence_ids
        ends[asynchronous] = (outputs[-1].outputs[0].token_ids, outputs[-1].outputs[0].finish_reason)
    assert ends[True] == ends[False] == (tokens[: last + 1], "stop")


def _streamed(asynchronous: bool, abort_at: int | None = None, registry: bool = False) -> dict[str, tuple]:
    """Each request's text and token ids as its delta outputs add up, stepping the engine by hand; with
    ``abort_at``, ``r0`` is cancelled after that many steps (while a token of its is in flight), through
    the registry directly with ``registry``."""
    engine = _llm(asynchronous).engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, _params(), strict=True)):
        params.output_kind = "delta"
        if params.best_of is None and not params.use_beam_search:
            engine.add_request(f"r{i}", prompt, params)
    streams: dict[str, tuple] = {}
    steps = 0
    while engine.has_unfinished_requests():
        _add_deltas(streams, engine.step())
        steps += 1
        if steps == abort_at:
            abort = engine.registry.abort if registry else engine.abort_request
            assert abort("r0", SequenceStatus.CANCELLED)
        engine.check_invariants()
    assert len(engine.terminal_records) == len({r.request_id for r in engine.terminal_records})
    assert not engine.kv.sequence_ids  # every block and record released
    return streams


def _add_deltas(streams: dict[str, tuple], outputs) -> None:
    ids = [out.request_id for out in outputs]
    assert len(ids) == len(set(ids))  # a step gives at most one output per request
    for out in outputs:
        for c in out.outputs:
            text, tokens = streams.get(f"{out.request_id}/{c.index}", ("", []))
            streams[f"{out.request_id}/{c.index}"] = (text + c.text, tokens + c.token_ids)


def test_streamed_deltas_add_up_to_the_synchronous_text():
    assert _streamed(True) == _streamed(False)


@pytest.mark.parametrize("abort_at, registry", [(2, False), (5, False), (3, True)])
def test_a_cancel_while_a_token_is_in_flight_drops_that_token_only(abort_at, registry):
    """The cancelled request's streamed text is what the synchronous engine had appended by then; its
    in-flight token is dropped; every other request is unaffected."""
    got, want = _streamed(True, abort_at, registry), _streamed(False, abort_at, registry)
    cancelled = {k for k in want if k.startswith("r0/")}
    assert {k: v for k, v in got.items() if k not in cancelled} == {
        k: v for k, v in want.items() if k not in cancelled
    }
    for key in cancelled:  # one step later on the host: at most the synchronous text
        assert want[key][1][: len(got[key][1])] == got[key][1]
        assert len(want[key][1]) - len(got[key][1]) <= 1


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemptions_with_tokens_in_flight_give_the_synchronous_outputs(mode):
    """A cache too small for the batch: sequences are preempted (recomputed or swapped) while a token of
    theirs is in flight; the tokens and ends still equal the synchronous engine's."""
    engine = {
        "num_kv_blocks": 14,
        "block_size": 4,
        "max_num_batched_tokens": 32,
        "preemption_mode": mode,
        "swap_space": 0.01 if mode == "swap" else 0.0,
    }
    prompts = [[(13 * i + 5 * j) % 200 + 20 for j in range(5 + 2 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, ignore_eos=True)
    results = {}
    for asynchronous in (False, True):
        llm = _llm(asynchronous, **engine)
        outputs = llm.generate(prompts, params)
        llm.engine.check_invariants()
        assert llm.engine.stats.preemptions > 0  # the scenario really preempts
        results[asynchronous] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outputs]
    assert results[True] == results[False]


def test_grammars_stops_and_token_masks_swapped_with_tokens_in_flight_give_the_roomy_engines_outputs():
    """Swap preemption with tokens in flight, beside a grammar, a stop string, min_tokens with
    allowed_token_ids and seeded parallel samples: each request's outputs are those of a synchronous
    engine whose cache never preempts."""
    prompts = [[(13 * i + 5 * j) % 200 + 20 for j in range(5 + 2 * i)] for i in range(6)]
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True) for _ in prompts]
    params[1] = SamplingParams(max_tokens=12, temperature=0.9, seed=5, n=2, ignore_eos=True)
    params[2] = SamplingParams(
        temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,5}x")
    )
    params[3] = SamplingParams(temperature=0, max_tokens=12, stop=["Rn"])
    params[4] = SamplingParams(temperature=0, max_tokens=12, min_tokens=6, allowed_token_ids=[2, 77, 78, 79])
    small = {"num_kv_blocks": 13, "block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 32}
    swapping = _llm(True, **small, max_model_len=48, preemption_mode="swap", swap_space=0.01)
    got = [
        [(c.token_ids, c.finish_reason, c.text) for c in o.outputs]
        for o in swapping.generate(prompts, params)
    ]
    want = [
        [(c.token_ids, c.finish_reason, c.text) for c in o.outputs]
        for o in _llm(False, block_size=4, max_model_len=48).generate(prompts, params)
    ]
    assert got == want
    assert swapping.engine.stats.preemptions > 0 and swapping.engine.output_processor.num_in_flight_steps > 0
    assert got[2] == [([102, 103, 102, 103, 102, 103, 100, 101, 123], "stop", "cdcdcdabx")]
    assert got[3] == [([450, 85, 380], "stop", "cau")]
    assert got[4][0][0] == [79] * 12


def test_structured_outputs_follow_their_grammar_with_tokens_in_flight(tiny_model_dir):
    """The grammar advances when a token is appended on the host, before the next step's mask is built,
    so a constrained request's output is the synchronous engine's."""
    params = SamplingParams(
        temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=r"(ab|cd){2,5}x")
    )
    prompts = ["hello there", "x", "Describe it:"]
    engine = {"num_kv_blocks": 128, **ENGINE_DEVICE}
    want = [o.outputs[0].text for o in LLM(str(tiny_model_dir), **engine).generate(prompts, params)]
    llm = LLM(str(tiny_model_dir), **engine, async_scheduling=True)
    got = [o.outputs[0].text for o in llm.generate(prompts, params)]
    assert got == want and all(t.endswith("x") for t in got)
    assert llm.engine.output_processor.num_in_flight_steps > 0


@pytest.mark.parametrize(
    "extra",
    [{"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, {"tensor_parallel_size": 2}],
)
def test_async_scheduling_with_speculation_or_tensor_parallelism_is_refused(extra):
    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineArgs(model="tiny-random", async_scheduling=True, **extra).create_config()


#: what the rows of the CUDA sync check use besides temperature, top-p and top-k: nothing, or the logits
#: processors (penalties, logit bias, allowed ids, min_tokens' and the n-gram ban's masks), which run
#: every step they are in the batch
_ROW_EXTRAS = {
    "plain": [{}],
    "processors": [
        {"repetition_penalty": 1.3},
        {"frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"logit_bias": {7: 5.0, 11: -5.0}},
        {"allowed_token_ids": list(range(20, 120))},
        {"min_tokens": 30, "no_repeat_ngram_size": 2},
    ],
}


@pytest.mark.skipif(ENGINE_DEVICE["device"] != "cuda", reason="host syncs exist only with a GPU")
@pytest.mark.parametrize("rows", sorted(_ROW_EXTRAS))
def test_a_decode_step_waits_for_the_device_only_to_read_the_last_steps_tokens(monkeypatch, rows):
    """On CUDA, with every row in flight (sampled and greedy, no logprobs), the only place a step may wait
    for the device is ``InFlightTokens.take``, which reads the previous step's ids once this step's
    forward is launched. Host lists reach the device through pinned non-blocking copies (a pageable copy
    waits for the forward)."""
    import torch

    from kvpilot.engine.in_flight import InFlightTokens

    llm = _llm(True)
    engine = llm.engine
    extras = _ROW_EXTRAS[rows]
    for i, prompt in enumerate(PROMPTS):
        temperature = 0.0 if i % 2 else 0.8
        params = SamplingParams(
            max_tokens=40,
            temperature=temperature,
            top_p=0.9,
            top_k=20,
            ignore_eos=True,
            **extras[i % len(extras)],
        )
        engine.add_request(f"r{i}", prompt, params)
    while any(s.num_output_tokens < 2 for s in engine.sequences.values()):
        engine.step()  # prompts done, every sequence decoding, a step's tokens in flight
    take = InFlightTokens.take

    def take_allowing_its_wait(self):
        torch.cuda.set_sync_debug_mode("default")
        try:
            return take(self)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    monkeypatch.setattr(InFlightTokens, "take", take_allowing_its_wait)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            engine.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert engine.output_processor.in_flight is not None
