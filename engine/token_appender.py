"""Appending a sampled token to its sequence, and every stop check (``TokenAppender``).

Per token: the grammar advances, timings and the n-gram index are updated, the sample's text is worked out
incrementally with possible stop strings held back, then EOS / stop tokens / stop strings / ``max_tokens`` /
the context limit are checked; a finished sequence's blocks are released at once and its request ends
through the registry's one terminal routine (``sequence_registry``).

Asynchronous output processing (``defer_detokenize``, on CUDA): a plain sample's text and stop strings wait
for the next step, whose ``flush_deferred`` runs while the device computes that step's forward
(docs/architecture.md#asynchronous-output-processing); every other stop is still found when the token is
appended.
"""

from __future__ import annotations

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.logits_processors import update_ngram_index
from kvpilot.engine.sampling.sampler_output import NO_TOKEN
from kvpilot.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvpilot.engine.sequence_group import SampleState, SequenceGroup
from kvpilot.engine.sequence_registry import SequenceRegistry
from kvpilot.engine.stats import EngineStats

S = SequenceStatus


class TokenAppender:
    """Appends tokens, finds the stops, and ends what finished."""

    def __init__(
        self, registry: SequenceRegistry, stats: EngineStats, max_model_len: int, defer_detokenize: bool
    ) -> None:
        self.registry = registry
        self.stats = stats
        self.max_model_len = max_model_len
        #: leave plain samples' detokenization and stop-string checks to the next step's
        #: ``flush_deferred`` (set by the engine on CUDA); False = in the step that samples the token
        self.defer_detokenize = defer_detokenize
        #: tokens whose text was deferred so far (a figure for tests and logs)
        self.num_deferred_tokens = 0
        self._deferred: list[tuple[Sequence, SampleState]] = []

    def append(
        self,
        seq: Sequence,
        token: int,
        now: float,
        logprob: float | None,
        top: dict[int, Logprob] | None,
        defer: bool = False,
    ) -> None:
        """Append ``token`` and check the stops; with ``defer``, a sample that detokenizes and does not stop
        otherwise keeps the token's text and stop strings for ``flush_deferred``. ``NO_TOKEN`` (the
        constraints left no token) appends nothing and ends the sequence with finish reason "error"."""
        if token == NO_TOKEN:
            group: SequenceGroup = seq.group
            self.registry.touched(group)
            self._finish(seq, group.sample_of(seq), FinishReason.ERROR, None)
            return
        seq.append_output_token(token)
        if seq.grammar is not None:
            seq.grammar.accept(token)  # a refused token leaves the matcher in error: _stop_reason ends it
        self.stats.generation_tokens += 1
        times = seq.times
        if times.first_token is None:
            times.first_token = now
        times.last_token = now
        times.token_times.append(now)
        if seq.status in (S.PREFILL, S.RUNNABLE):
            seq.transition(S.DECODE)
        if seq.params.no_repeat_ngram_size:
            update_ngram_index(seq.ngram_index, seq.output_token_ids, seq.params.no_repeat_ngram_size)
        group = seq.group
        if group.beam is not None:
            self.registry.touched(group)
            return
        sample = group.sample_of(seq)
        if defer and sample.detok is not None and self._stop_reason(seq, token, None)[0] is None:
            if not sample.pending:
                self._deferred.append((seq, sample))
            sample.pending.append((token, logprob, top))
            self.num_deferred_tokens += 1
            return
        self.registry.touched(group)
        matched = group.take_pending(sample)  # empty: the step flushed before sampling
        matched = group.on_token(sample, token, logprob, top) or matched
        reason, stop_reason = self._stop_reason(seq, token, matched)
        if reason is not None:
            self._finish(seq, sample, reason, stop_reason)

    def flush_deferred(self, request_id: str | None = None) -> None:
        """The deferred tokens' text and stop strings: a stop string ends its sequence now, one step after
        its token was sampled (the engine calls this before the step's sampling, so that sequence's new
        row is dropped and its outputs equal the synchronous path's). With ``request_id``, only that
        request's: ending others outside a step would leave their final outputs waiting for one."""
        if request_id is None:
            deferred, self._deferred = self._deferred, []
        else:
            deferred = [d for d in self._deferred if d[0].group.request_id == request_id]
            self._deferred = [d for d in self._deferred if d[0].group.request_id != request_id]
        for seq, sample in deferred:
            if not sample.pending:  # ended meanwhile: ``on_finish`` took them
                continue
            self.registry.touched(seq.group)
            matched = seq.group.take_pending(sample)
            if matched is not None:
                self._finish(seq, sample, FinishReason.STOP, matched)

    def expire(self, now: float) -> None:
        """Time out the requests whose deadline has passed at ``now``, after the deferred tokens' stops
        (a request a stop string ended in time is not timed out)."""
        if self.registry.expired(now):
            self.flush_deferred()
            self.registry.expire(now)

    def _finish(
        self, seq: Sequence, sample: SampleState, reason: FinishReason, stop_reason: str | int | None
    ) -> None:
        group: SequenceGroup = seq.group
        reason = group.on_finish(sample, reason, stop_reason)
        self.registry.release(seq, S.FINISHED, reason)
        if not group.live_samples():
            self.registry.reclaim(group, S.FINISHED, group.samples_finish_reason())

    def _stop_reason(
        self, seq: Sequence, token: int, matched: str | None
    ) -> tuple[FinishReason | None, str | int | None]:
        p = seq.params
        if matched is not None:
            return FinishReason.STOP, matched
        if seq.grammar is not None and seq.grammar.is_finished:
            # the grammar is complete (or refused a token other constraints forced, an error)
            return (FinishReason.STOP if seq.grammar.error is None else FinishReason.ERROR), None
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in seq.eos_token_ids:
                return FinishReason.STOP, None
            if token in p.stop_token_ids:
                return FinishReason.STOP, token
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH, None
        if seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None
