"""Cumulative engine outputs → deltas: new tokens travel with the text they produce; tokens whose text is
held back wait; a sample's finish is sent once; prompt logprobs ride on the first chunk only."""

from __future__ import annotations

from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.engine.server.output_deltas import DeltaTracker


def output(samples: list[tuple[str, list[int], str | None]], finished: bool = False, prompt_logprobs=None):
    outs = [
        CompletionOutput(i, text, tokens, finish_reason=reason)
        for i, (text, tokens, reason) in enumerate(samples)
    ]
    return RequestOutput(
        "r", None, [1, 2, 3], outs, finished, num_cached_tokens=0, prompt_logprobs=prompt_logprobs
    )


def test_held_back_tokens_leave_with_the_next_text():
    tracker = DeltaTracker(detokenize=True)
    first = tracker.update(output([("He", [10], None)], prompt_logprobs=[None, {2: Logprob(-1.0, 1)}]))
    assert [(d.text, d.token_ids) for d in first.samples] == [("He", (10,))]
    assert first.prompt_logprobs == [None, {2: Logprob(-1.0, 1)}] and first.num_prompt_tokens == 3
    assert tracker.update(output([("He", [10, 11], None)])) is None  # token 11's text is held back
    second = tracker.update(output([("Hello", [10, 11, 12], None)]))
    assert [(d.text, d.token_ids) for d in second.samples] == [("llo", (11, 12))]
    assert second.prompt_logprobs is None
    last = tracker.update(output([("Hello", [10, 11, 12, 2], "stop")], finished=True))
    assert [(d.text, d.token_ids, d.finish_reason) for d in last.samples] == [("", (2,), "stop")]
    assert last.finished


def test_samples_finish_once_and_token_only_requests_send_every_token():
    tracker = DeltaTracker(detokenize=False)
    chunk = tracker.update(output([("", [5], "length"), ("", [6], None)]))
    assert [(d.index, d.token_ids, d.finish_reason) for d in chunk.samples] == [
        (0, (5,), "length"),
        (1, (6,), None),
    ]
    chunk = tracker.update(output([("", [5], "length"), ("", [6, 7], "length")], finished=True))
    assert [(d.index, d.token_ids) for d in chunk.samples] == [(1, (7,))]


def test_logprobs_follow_their_tokens():
    tracker = DeltaTracker(detokenize=True)
    lps = [{10: Logprob(-0.1, 1)}, {11: Logprob(-0.2, 1)}]
    out = output([("ab", [10, 11], None)])
    out.outputs[0].logprobs = lps
    (delta,) = tracker.update(out).samples
    assert delta.logprobs == tuple(lps)
