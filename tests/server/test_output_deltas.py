"""The engine's delta outputs → chunks: new tokens travel with the text they produce; tokens whose text is
held back wait; a sample's finish is sent once; prompt logprobs ride on the first chunk only."""

from __future__ import annotations

from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvpilot.engine.server.output_deltas import DeltaTracker


def output(
    samples: list[tuple[int, str, list[int], str | None]], finished: bool = False, prompt_logprobs=None
):
    """A delta output: per sample (index, new text, new tokens, finish reason)."""
    outs = [CompletionOutput(i, text, tokens, finish_reason=reason) for i, text, tokens, reason in samples]
    return RequestOutput(
        "r", None, [1, 2, 3], outs, finished, num_cached_tokens=0, prompt_logprobs=prompt_logprobs
    )


def test_held_back_tokens_leave_with_the_next_text():
    tracker = DeltaTracker(detokenize=True)
    first = tracker.update(output([(0, "He", [10], None)], prompt_logprobs=[None, {2: Logprob(-1.0, 1)}]))
    assert [(d.text, d.token_ids) for d in first.samples] == [("He", (10,))]
    assert first.prompt_logprobs == [None, {2: Logprob(-1.0, 1)}] and first.num_prompt_tokens == 3
    assert tracker.update(output([(0, "", [11], None)])) is None  # token 11's text is held back
    second = tracker.update(output([(0, "llo", [12], None)]))
    assert [(d.text, d.token_ids) for d in second.samples] == [("llo", (11, 12))]
    assert second.prompt_logprobs is None
    last = tracker.update(output([(0, "", [2], "stop")], finished=True))
    assert [(d.text, d.token_ids, d.finish_reason) for d in last.samples] == [("", (2,), "stop")]
    assert last.finished


def test_samples_finish_once_and_token_only_requests_send_every_token():
    tracker = DeltaTracker(detokenize=False)
    chunk = tracker.update(output([(0, "", [5], "length"), (1, "", [6], None)]))
    assert [(d.index, d.token_ids, d.finish_reason) for d in chunk.samples] == [
        (0, (5,), "length"),
        (1, (6,), None),
    ]
    chunk = tracker.update(output([(1, "", [7], "length")], finished=True))  # sample 0 is done: absent
    assert [(d.index, d.token_ids) for d in chunk.samples] == [(1, (7,))]


def test_logprobs_follow_their_tokens():
    tracker = DeltaTracker(detokenize=True)
    lps = [{10: Logprob(-0.1, 1)}, {11: Logprob(-0.2, 1)}]
    out = output([(0, "", [10], None)])
    out.outputs[0].logprobs = lps[:1]
    assert tracker.update(out) is None  # held with its token
    out = output([(0, "ab", [11], None)])
    out.outputs[0].logprobs = lps[1:]
    (delta,) = tracker.update(out).samples
    assert delta.token_ids == (10, 11) and delta.logprobs == tuple(lps)
