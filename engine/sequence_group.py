"""A user request and its sequences: one for plain sampling, ``best_of`` parallel samples, or the beams of
a beam search. Samples share the prompt's KV blocks by reference count (forked after the prompt's
prefill); each keeps its own detokenizer, stop-string buffer and logprobs. The group builds the
``RequestOutput`` the caller sees (stop-safe text): cumulative, only what is new since the previous output
(``output_kind="delta"``), or one output at the end (``final_only``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.beam_search import BeamSearch
from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStringBuffer
from kvpilot.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import FinishReason, Sequence
from kvpilot.engine.tokenizer import Tokenizer


@dataclass
class SampleState:
    """Output-side state of one sequence."""

    index: int
    seq: Sequence
    detok: IncrementalDetokenizer | None
    stops: StopStringBuffer
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] | None = None
    #: tokens whose text has been released (all of it, not held back)
    num_emitted: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    #: delta outputs: tokens (and their logprobs) already handed out, and whether its finish was sent
    sent_tokens: int = 0
    finish_sent: bool = False
    #: appended tokens whose text and stop strings wait for the next step (asynchronous output
    #: processing): (token, sampled logprob, top logprobs) each, given to ``on_token`` by ``take_pending``
    pending: list[tuple[int, float | None, dict[int, Logprob] | None]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.stops.released

    @property
    def token_ids(self) -> list[int]:
        """The sequence's output tokens ``on_token`` has recorded (not the ``pending`` ones): what its
        outputs hold, so that token ids, logprobs and text cover the same tokens."""
        tokens = self.seq.output_token_ids
        return tokens[: len(tokens) - len(self.pending)] if self.pending else tokens

    def output(
        self,
        index: int,
        with_scores: bool,
        text: str,
        token_ids: list[int],
        logprobs: list[dict[int, Logprob]] | None,
    ) -> CompletionOutput:
        """A ``CompletionOutput`` of this sample holding ``text``, ``token_ids`` and ``logprobs`` (all of
        them, or a delta's)."""
        return CompletionOutput(
            index=index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob if with_scores else None,
            logprobs=logprobs,
            finish_reason=self.finish_reason.value if self.finish_reason else None,
            stop_reason=self.stop_reason,
        )

    def complete(self, index: int, with_scores: bool) -> CompletionOutput:
        """Everything this sample has produced so far."""
        logprobs = list(self.logprobs) if self.logprobs is not None else None
        return self.output(index, with_scores, self.text, list(self.token_ids), logprobs)

    def delta(self, index: int, with_scores: bool) -> CompletionOutput | None:
        """What is new since this sample's previous delta (None: nothing, and its finish already sent)."""
        tokens = self.token_ids
        new_tokens, text = tokens[self.sent_tokens :], self.stops.take_released()
        finished = self.finish_reason is not None
        if not (new_tokens or text or (finished and not self.finish_sent)):
            return None
        logprobs = self.logprobs[self.sent_tokens :] if self.logprobs is not None else None
        self.sent_tokens, self.finish_sent = len(tokens), finished
        return self.output(index, with_scores, text, new_tokens, logprobs)


@dataclass
class SequenceGroup:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    tokenizer: Tokenizer
    samples: list[SampleState] = field(default_factory=list)
    beam: BeamSearch | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finished: bool = False
    #: terminal status of the whole request once ``finished``
    status: str | None = None

    @classmethod
    def start(
        cls, seq: Sequence, prompt: str | None, tokenizer: Tokenizer, max_model_len: int
    ) -> SequenceGroup:
        """The user request of a new sequence ``seq`` (its sample 0, or the first beam)."""
        params, token_ids = seq.params, seq.prompt_token_ids
        group = cls(seq.seq_id, prompt, token_ids, params, tokenizer)
        if params.use_beam_search:
            limit = max_model_len - len(token_ids)
            group.beam = BeamSearch(
                params.effective_beam_width,
                params.length_penalty,
                min(params.max_tokens or limit, limit),
                seq.eos_token_ids,
                params.ignore_eos,
                frozenset(params.stop_token_ids),
            )
            group.beam.start(seq.seq_id)
        if params.prompt_logprobs is not None:
            group.prompt_logprobs = [None] * len(token_ids)
        seq.group = group
        group.new_sample(seq, 0)
        return group

    @property
    def primary(self) -> Sequence:
        return self.samples[0].seq

    def new_sample(self, seq: Sequence, index: int) -> SampleState:
        p = self.params
        detok = (
            IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids, p.skip_special_tokens)
            if p.detokenize and self.beam is None
            else None
        )
        state = SampleState(
            index,
            seq,
            detok,
            StopStringBuffer(p.stop, p.include_stop_str_in_output),
            logprobs=[] if p.logprobs is not None else None,
        )
        self.samples.append(state)
        return state

    def sample_of(self, seq: Sequence) -> SampleState:
        for s in self.samples:
            if s.seq is seq:
                return s
        raise KeyError(seq.seq_id)

    def live_samples(self) -> list[SampleState]:
        return [s for s in self.samples if s.finish_reason is None]

    # ---- per token -------------------------------------------------------------------------------------
    def on_token(
        self, sample: SampleState, token: int, logprob: float | None, top: dict[int, Logprob] | None
    ) -> str | None:
        """Record a generated token; returns a matched stop string, if the text now contains one."""
        if logprob is not None:
            sample.cumulative_logprob += logprob
        if sample.logprobs is not None and top is not None:
            for tok, lp in top.items():
                lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
            sample.logprobs.append(top)
        if sample.detok is None:
            sample.num_emitted += 1
            return None
        matched = sample.stops.push(sample.detok.push(token))
        if not sample.stops.pending and matched is None:
            sample.num_emitted = sample.seq.num_output_tokens
        return matched

    def take_pending(self, sample: SampleState) -> str | None:
        """Record ``sample``'s deferred tokens in order (``on_token``); the stop string one completes."""
        pending, sample.pending = sample.pending, []
        matched = None
        for token, logprob, top in pending:
            matched = self.on_token(sample, token, logprob, top) or matched
        return matched

    def on_finish(
        self, sample: SampleState, reason: FinishReason, stop_reason: str | int | None
    ) -> FinishReason:
        """End ``sample`` with ``reason``; returns the reason it ended with (STOP when the text held back
        until now completes a stop string)."""
        self.take_pending(sample)  # however it ends, its text covers every appended token
        if sample.detok is not None and sample.stops.matched is None:
            # the detokenizer's held-back tail (an unfinished UTF-8 sequence) can complete a stop string
            matched = sample.stops.push(sample.detok.flush())
            if matched is not None:
                reason, stop_reason = FinishReason.STOP, matched
            sample.stops.flush()
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.num_emitted = sample.seq.num_output_tokens
        return reason

    # ---- outputs ---------------------------------------------------------------------------------------
    def completions(self) -> list[CompletionOutput]:
        """The ``n`` outputs: every sample, or for ``best_of``/beam search the best ``n`` when finished."""
        n = self.params.n
        if self.beam is not None:
            return self.beam.completions(n, self.tokenizer, self.params) if self.finished else []
        if self.hides_samples and not self.finished:
            return []
        return [s.complete(i, self.wants_scores) for i, s in enumerate(self.kept_samples())]

    def kept_samples(self) -> list[SampleState]:
        """The samples the user gets: all of them, or for ``best_of`` the ``n`` with the highest cumulative
        logprob among those that did not end in error (a sample left without a possible token scores only
        the tokens it had, so it would otherwise outrank every longer one)."""
        if not self.hides_samples:
            return self.samples
        return sorted(
            self.samples, key=lambda s: (s.finish_reason is FinishReason.ERROR, -s.cumulative_logprob)
        )[: self.params.n]

    def samples_finish_reason(self) -> FinishReason:
        """The request's reason once its last sample has ended: the best kept output's, ERROR only when
        every kept output ended in error (as for beams)."""
        reasons = [s.finish_reason for s in self.kept_samples() if s.finish_reason is not None]
        assert reasons, "every sample has ended"
        return next((r for r in reasons if r is not FinishReason.ERROR), reasons[0])

    @property
    def hides_samples(self) -> bool:
        """Beams and ``best_of`` samples are sent only when the request ends, and then only the ``n`` kept."""
        return self.beam is not None or len(self.samples) > self.params.n

    @property
    def wants_scores(self) -> bool:
        p = self.params
        return p.logprobs is not None or p.num_samples > p.n

    def make_output(self, num_cached_tokens: int) -> RequestOutput | None:
        """This step's output as ``params.output_kind`` asks (None: ``final_only`` before the end)."""
        kind = self.params.output_kind
        if kind == "final_only" and not self.finished:
            return None
        if kind == "delta" and not self.hides_samples:
            deltas = (s.delta(i, self.wants_scores) for i, s in enumerate(self.samples))
            outputs = [d for d in deltas if d is not None]
        else:  # cumulative; best_of and beams give their n kept outputs once, at the end, in every kind
            outputs = self.completions()
        t = self.primary.times
        last = max((s.seq.times.last_token or 0.0 for s in self.samples), default=0.0) or None
        metrics = RequestMetrics(
            arrival_time=t.arrival,
            first_scheduled_time=t.first_scheduled,
            first_token_time=t.first_token,
            last_token_time=last,
            finished_time=max((s.seq.times.finished or 0.0 for s in self.samples), default=0.0) or None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=num_cached_tokens,
            metrics=metrics,
            prompt_logprobs=self.prompt_logprobs,
        )
