"""The second half of an engine tick: logits → tokens → outputs (``OutputProcessor``).

- parallel samples: when a request with ``best_of``/``n`` > 1 finishes its prompt, the one logits row is
  sampled once per sample; samples 1.. are forked sequences sharing the prompt's KV blocks by reference
  count (copy-on-write of the shared partial block on first write): KV grows as M_prompt + n·M_generated.
- beams: each live beam reports its log-distribution; when all have, the beam search selects, forks the
  beams that continue with several tokens and releases those that continue with none.
- speculating sequences: their drafts are verified by the exact rule and what they emit is appended.
- per token: detokenize incrementally, hold back possible stop strings, check EOS / stop tokens / stop
  strings / max_tokens / context limit, release a finished sequence's blocks at once and end its request
  through the registry's one terminal routine (``sequence_registry``).
- asynchronous output processing (``defer_detokenize``, on CUDA): a sampled token's text and stop strings
  wait for the next step, whose ``flush_deferred`` runs while the device computes that step's forward
  (docs/architecture.md#asynchronous-output-processing); every other stop is still found when the token
  is appended.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvpilot.engine.input_batch import InputBatch, StepBatch
from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.logits_processors import RowState, update_ngram_index
from kvpilot.engine.sampling.sampler import Sampler, top_logprobs_of
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvpilot.engine.sequence_group import SampleState, SequenceGroup
from kvpilot.engine.sequence_registry import SequenceRegistry
from kvpilot.engine.spec_decode.verify import verify_drafts
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.tokenizer import Tokenizer

S = SequenceStatus


class OutputProcessor:
    """Turns a step's logits into tokens appended to their sequences (the sampler's rows, beams, verified
    drafts) and ends what finished."""

    def __init__(
        self,
        registry: SequenceRegistry,
        sampler: Sampler,
        input_batch: InputBatch,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        stats: EngineStats,
        max_model_len: int,
        defer_detokenize: bool = False,
    ) -> None:
        self.registry = registry
        self.sampler = sampler
        self.input_batch = input_batch
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.stats = stats
        self.max_model_len = max_model_len
        #: leave plain samples' detokenization and stop-string checks to the next step's
        #: ``flush_deferred`` (set by the engine on CUDA); False = in the step that samples the token
        self.defer_detokenize = defer_detokenize
        #: tokens whose text was deferred so far (a figure for tests and logs)
        self.num_deferred_tokens = 0
        self._deferred: list[tuple[Sequence, SampleState]] = []

    # ---- prompt logprobs -----------------------------------------------------------------------------
    def record_prompt_logprobs(self, batch: StepBatch, logits: torch.Tensor) -> None:
        for seq, first_row, count, first_pos in batch.prompt_spans:
            scored, top = seq.group.prompt_logprobs, seq.params.prompt_logprobs
            assert scored is not None and top is not None  # a prompt span only where it was asked for
            lp = logits[first_row : first_row + count].log_softmax(dim=-1)
            for i in range(count):
                pos = first_pos + i + 1  # the prompt token these logits score
                scored[pos] = self._decoded(top_logprobs_of(lp[i], seq.prompt_token_ids[pos], top))

    def _decoded(self, entries: dict[int, Logprob]) -> dict[int, Logprob]:
        for tok, lp in entries.items():
            lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        return entries

    # ---- sampling ------------------------------------------------------------------------------------
    def sample(self, seqs: list[Sequence], logits: torch.Tensor, row_counts: list[int]) -> None:
        """``logits``: ``row_counts[i]`` consecutive rows per sequence — one, or 1 + its drafts when it
        speculates (verified by ``_verify``). A sequence that ended since the batch was built (a stop
        string ``flush_deferred`` found) is not sampled: its row is the one extra a deferred stop costs."""
        starts = np.cumsum([0, *row_counts[:-1]])
        if any(seq.is_finished for seq in seqs):
            keep = [i for i, seq in enumerate(seqs) if not seq.is_finished]
            kept_rows = [r for i in keep for r in range(starts[i], starts[i] + row_counts[i])]
            logits = logits.index_select(0, torch.tensor(kept_rows, dtype=torch.long, device=logits.device))
            seqs, row_counts = [seqs[i] for i in keep], [row_counts[i] for i in keep]
            starts = np.cumsum([0, *row_counts[:-1]])
            if not seqs:
                return
        if len(row_counts) == logits.shape[0]:
            self._sample_rows(seqs, logits)
            return
        plain = [i for i, c in enumerate(row_counts) if c == 1]
        if plain:
            index = torch.from_numpy(starts[plain]).to(logits.device)
            self._sample_rows([seqs[i] for i in plain], logits.index_select(0, index))
        spec = [i for i, c in enumerate(row_counts) if c > 1]
        rows = np.concatenate([np.arange(starts[i], starts[i] + row_counts[i]) for i in spec])
        self._verify(
            [seqs[i] for i in spec], logits.index_select(0, torch.from_numpy(rows).to(logits.device))
        )

    def _verify(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Accept each speculating sequence's drafts by the exact rule, append what it emits, and roll its
        KV back to its tokens (docs/architecture.md#speculative-decoding)."""
        generators = [self.registry.generators.get(s.seq_id) for s in seqs]
        expanded = [s for s in seqs for _ in range(1 + len(s.spec_token_ids))]
        verified = verify_drafts(
            self.sampler,
            logits,
            seqs,
            generators,
            self.input_batch.sampling_tensors(expanded),
            [s.params.logprobs is not None or s.group.wants_scores for s in seqs],
        )
        now = time.monotonic()
        for seq, result in zip(seqs, verified, strict=True):
            self.stats.record_verification(len(seq.spec_token_ids), result.num_accepted)
            seq.num_draft_tokens += len(seq.spec_token_ids)
            seq.num_accepted_tokens += result.num_accepted
            for token, lp, top in zip(result.token_ids, result.logprobs, result.top_logprobs, strict=True):
                self._append(seq, token, now, lp, top)
                if seq.is_finished:  # a stop, EOS or max_tokens cut the speculation: the rest is dropped
                    break
            else:
                self.scheduler.rollback_drafts(seq, result.num_accepted)

    def _sample_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        rows: list[tuple[Sequence, str]] = []  # (sequence, kind: sample | beam)
        sources: list[int] = []
        for src, seq in enumerate(seqs):
            group: SequenceGroup = seq.group
            if group.beam is not None:
                rows.append((seq, "beam"))
                sources.append(src)
            elif seq.num_output_tokens == 0 and len(group.samples) == 1 and group.params.num_samples > 1:
                rows.append((seq, "sample"))
                sources.append(src)
                for i in range(1, group.params.num_samples):  # fork before any token is appended
                    rows.append((self.registry.fork(seq, f"{group.request_id}#{i}", i), "sample"))
                    sources.append(src)
            else:
                rows.append((seq, "sample"))
                sources.append(src)
        row_logits = (
            logits
            if len(sources) == len(seqs)
            else logits.index_select(0, torch.tensor(sources, device=logits.device))
        )
        states = [
            RowState(
                s.params,
                s.prompt_token_ids,
                s.output_token_ids,
                s.eos_token_ids,
                s.bad_word_ids,
                s.ngram_index,
                self.registry.generators.get(s.seq_id),
                s.grammar,
            )
            for s, _ in rows
        ]
        res = self.sampler.sample(
            row_logits,
            states,
            want_sampled_logprob=[s.group.wants_scores for s, _ in rows],
            want_full=[kind == "beam" for _, kind in rows],
            row_params=self.input_batch.sampling_tensors([s for s, _ in rows]),
        )
        now = time.monotonic()
        beams_ready: list[SequenceGroup] = []
        for i, (seq, kind) in enumerate(rows):
            if kind == "beam":
                # once per group: two beams recomputed after a preemption can both complete the set
                beam = seq.group.beam
                assert beam is not None and res.full_logprobs is not None
                if beam.report(seq.seq_id, res.full_logprobs[i]) and seq.group not in beams_ready:
                    beams_ready.append(seq.group)
            else:
                self._append(
                    seq,
                    res.token_ids[i],
                    now,
                    res.sampled_logprobs[i],
                    res.top_logprobs[i],
                    self.defer_detokenize,
                )
        for group in beams_ready:
            self._beam_step(group, now)

    # ---- per token -----------------------------------------------------------------------------------
    def _append(
        self,
        seq: Sequence,
        token: int,
        now: float,
        logprob: float | None,
        top: dict[int, Logprob] | None,
        defer: bool = False,
    ) -> None:
        """Append ``token`` and check the stops; with ``defer``, a sample that detokenizes and does not stop
        otherwise keeps the token's text and stop strings for ``flush_deferred``."""
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
        group: SequenceGroup = seq.group
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
        group.on_finish(sample, reason, stop_reason)
        self.registry.release(seq, S.FINISHED, reason)
        if not group.live_samples():
            self.registry.reclaim(group, S.FINISHED, reason)

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

    # ---- beams ---------------------------------------------------------------------------------------
    def _beam_step(self, group: SequenceGroup, now: float) -> None:
        beam = group.beam
        assert beam is not None  # only beam-search groups get here
        step = beam.select()
        for key in step.drop:
            self.registry.release(self.registry.sequences[key], S.FINISHED, FinishReason.STOP)
        targets: list[tuple[Sequence, int, float]] = []
        used: set[str] = set()
        for c in step.continue_with:  # fork duplicates first, while every parent still has its old tokens
            parent = self.registry.sequences[c.parent]
            seq = (
                parent
                if c.parent not in used
                else self.registry.fork(
                    parent, f"{group.request_id}#b{len(group.samples)}", len(group.samples)
                )
            )
            used.add(c.parent)
            targets.append((seq, c.token, c.cum_logprob))
        for seq, token, _ in targets:
            self._append(seq, token, now, None, None)
        beam.rekey({seq.seq_id: (list(seq.output_token_ids), cum) for seq, _, cum in targets})
        if step.done:
            for seq, _, _ in targets:
                self.registry.release(seq, S.FINISHED, FinishReason.STOP)
            self.registry.reclaim(group, S.FINISHED, FinishReason.STOP)
