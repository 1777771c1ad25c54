"""The second half of an engine tick: logits → tokens → outputs (``OutputProcessor``).

- parallel samples: when a request with ``best_of``/``n`` > 1 finishes its prompt, the one logits row is
  sampled once per sample; samples 1.. are forked sequences sharing the prompt's KV blocks by reference
  count (copy-on-write of the shared partial block on first write): KV grows as M_prompt + n·M_generated.
- beams: each live beam reports its log-distribution; when all have, the beam search selects, forks the
  beams that continue with several tokens and releases those that continue with none.
- speculating sequences: their drafts are verified by the exact rule and what they emit is appended.
- per token (``TokenAppender``, ``engine/token_appender.py``): append, detokenize, check every stop, end
  what finished; on CUDA a token's text and stop strings can wait for the next step's forward
  (asynchronous output processing).
- asynchronous scheduling (``async_scheduling``): the rows that want no logprobs, scores or beams leave
  their tokens on the device (``engine/in_flight.py``); the next step is scheduled and launched first,
  then ``resolve_in_flight`` appends them, with every stop check, while that step computes
  (docs/architecture.md#asynchronous-scheduling). The other rows sample as before.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from kvpilot.engine.in_flight import InFlightTokens, TokenCopy
from kvpilot.engine.input_batch import InputBatch, StepBatch
from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.sampler import Sampler
from kvpilot.engine.sampling.sampler_output import top_logprobs_of
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvpilot.engine.sequence_group import SequenceGroup
from kvpilot.engine.sequence_registry import SequenceRegistry
from kvpilot.engine.spec_decode.verify import verify_drafts
from kvpilot.engine.staging import to_device
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.token_appender import TokenAppender
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
        async_scheduling: bool = False,
    ) -> None:
        self.registry = registry
        self.sampler = sampler
        self.input_batch = input_batch
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.stats = stats
        #: appending each token and its stop checks (``defer_detokenize``: asynchronous output processing)
        self.appender = TokenAppender(registry, stats, max_model_len, defer_detokenize)
        #: leave a step's plain samples on the device for ``resolve_in_flight`` (asynchronous scheduling)
        self.async_scheduling = async_scheduling
        #: the last step's tokens not yet appended; None when every sampled token is
        self.in_flight: InFlightTokens | None = None
        #: steps whose tokens were left in flight so far (a figure for tests and logs)
        self.num_in_flight_steps = 0
        self._token_copy = TokenCopy(input_batch.device)

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
            logits = logits.index_select(0, to_device(kept_rows, torch.long, logits.device))
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
                self.appender.append(seq, token, now, lp, top)
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
            else logits.index_select(0, to_device(sources, torch.long, logits.device))
        )
        if self.async_scheduling:
            rows, row_logits = self._sample_in_flight(rows, row_logits)
            if not rows:
                return
        states = [self._row_state(s) for s, _ in rows]
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
                self.appender.append(
                    seq,
                    res.token_ids[i],
                    now,
                    res.sampled_logprobs[i],
                    res.top_logprobs[i],
                    self.appender.defer_detokenize,
                )
        for group in beams_ready:
            self._beam_step(group, now)

    def resolve_in_flight(self) -> None:
        """Append the last step's tokens left on the device, with their stop checks (the engine calls it
        once this step's forward is launched, before this step samples)."""
        in_flight, self.in_flight = self.in_flight, None
        if in_flight is None:
            return
        now = time.monotonic()
        for seq, token in in_flight.take():
            if not seq.is_finished:  # aborted or timed out since it was sampled: the token is dropped
                self.appender.append(seq, token, now, None, None)

    def _sample_in_flight(
        self, rows: list[tuple[Sequence, str]], logits: torch.Tensor
    ) -> tuple[list[tuple[Sequence, str]], torch.Tensor]:
        """Sample the plain rows (no logprobs, scores or beams) onto the device for ``resolve_in_flight``;
        the rows left, and their logits, sample synchronously."""
        plain = [
            i
            for i, (s, kind) in enumerate(rows)
            if kind == "sample" and s.params.logprobs is None and not s.group.wants_scores
        ]
        if not plain:
            return rows, logits
        assert self.in_flight is None, "the last step's tokens were not resolved before sampling"
        keep = set(plain)
        rest = [i for i in range(len(rows)) if i not in keep]
        device = logits.device
        seqs = [rows[i][0] for i in plain]
        ids = self.sampler.sample_tokens(
            logits if not rest else logits.index_select(0, to_device(plain, torch.long, device)),
            [self._row_state(s) for s in seqs],
            self.input_batch.sampling_tensors(seqs),
        )
        self.in_flight = InFlightTokens(seqs, ids, self._token_copy)
        self.num_in_flight_steps += 1
        if not rest:
            return [], logits
        return [rows[i] for i in rest], logits.index_select(0, to_device(rest, torch.long, device))

    def _row_state(self, s: Sequence) -> RowState:
        return RowState(
            s.params,
            s.prompt_token_ids,
            s.output_token_ids,
            s.eos_token_ids,
            s.bad_word_ids,
            s.ngram_index,
            self.registry.generators.get(s.seq_id),
            s.grammar,
        )

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
            self.appender.append(seq, token, now, None, None)
        beam.rekey({seq.seq_id: (list(seq.output_token_ids), cum) for seq, _, cum in targets})
        if step.done:
            for seq, _, _ in targets:
                self.registry.release(seq, S.FINISHED, FinishReason.STOP)
            kept = beam.best(group.params.n)
            # every hypothesis kept ended without a possible token: the request ends in error, as a sample's
            ended = (
                FinishReason.ERROR
                if kept and all(h.finish_reason == "error" for h in kept)
                else FinishReason.STOP
            )
            self.registry.reclaim(group, S.FINISHED, ended)
