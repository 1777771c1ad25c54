"""The logits → token pipeline, batched, in one fixed and documented order:

1. constraints: grammar (structured outputs, a token bitmask) → allowed_token_ids → logit_bias (±100) →
   bad_words → min_tokens → no_repeat_ngram_size
2. penalties: repetition (prompt + output) → frequency / presence (output)
3. temperature: T = 0 is a separate greedy branch (argmax of the constrained logits, ties → lowest id);
   the truncation filters do not apply to it. 0 < T < ``NEAR_ZERO_TEMPERATURE`` draws from the T → 0
   limit (uniform over the maximal logits) rather than dividing by a T that would overflow
4. truncation on z/T: min_p → top_k → top_p → typical_p (``filters.py``)
5. sampling by inverse CDF with one uniform number per row (``draw.py``), an exact draw from p. A seeded
   request draws its number from its own generator, so its tokens do not depend on what else is in the batch.

Fast paths: an all-greedy batch without constraints, penalties or logprobs is a single argmax; steps
2–4 run only for the rows whose parameters use them, chosen on the host (``row_params.FilterRows``): the
pipeline asks the device nothing until the sampled ids come back. On a CPU with the native kernels, steps
3–5 of the sampled rows run in C (``engine/native/sampling.c``: the same support sets and draw, one pass
per row instead of full-vocabulary sorts and masks; rows with typical-p or a near-zero temperature take the
tensor steps beside it) unless a row needs its processed distribution (processed logprobs, beams); the
tensor pipeline is its reference. The per-row parameters come as tensors (``SamplingTensors``), gathered
by the engine from its persistent batch.

Logprobs: ``raw_logprobs`` report the model's own distribution (log-softmax of the raw logits);
``processed_logprobs`` report the distribution the token was drawn from (after steps 1–4; for greedy rows
after steps 1–2).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.native.sampling_ops import SamplingKernels
from kvpilot.engine.sampling.draw import inverse_cdf_draw, uniform_numbers
from kvpilot.engine.sampling.filters import NEG_INF, apply_min_p, apply_top_k, apply_top_p, apply_typical_p
from kvpilot.engine.sampling.logits_processors import RowState, apply_constraints, apply_penalties
from kvpilot.engine.sampling.params import NEAR_ZERO_TEMPERATURE
from kvpilot.engine.sampling.row_params import FilterRows, SamplingTensors
from kvpilot.engine.sampling.sampler_output import NO_TOKEN, SamplerOutput, sampler_output
from kvpilot.engine.staging import to_device
from kvpilot.engine.structured.bitmask import GrammarMasks


@dataclass
class Distributions:
    """Steps 1-4 applied to a batch of rows, before the draw."""

    #: constrained and penalised logits of every row (greedy rows take their argmax)
    proc: torch.Tensor
    #: the rows that sample (temperature > 0), ascending
    sample_rows: list[int]
    #: ``sample_rows`` on the device; None when every row samples
    idx: torch.Tensor | None
    #: [len(sample_rows), V] the sampled rows' filtered z/T (its softmax is what they are drawn from)
    scaled: torch.Tensor | None
    #: [N] bool on the device: rows whose constraints leave no token (``NO_TOKEN`` is drawn there); None
    #: when no row has constraints
    dead: torch.Tensor | None = None

    @property
    def every_row_samples(self) -> bool:
        return self.scaled is not None and self.idx is None

    def drawn_from(self) -> torch.Tensor:
        """[N, V] logits of the distribution each row is drawn from (greedy rows: the constrained ones)."""
        if self.scaled is None:
            return self.proc
        if self.idx is None:
            return self.scaled
        final = self.proc.clone()
        final.index_copy_(0, self.idx, self.scaled)
        return final


def _stages_needed(states: Sequence[RowState]) -> tuple[bool, bool]:
    """Whether any row has constraints (step 1) / penalties (step 2)."""
    constraints = any(st.params.needs_masks or st.bad_word_ids or st.grammar is not None for st in states)
    return constraints, any(st.params.needs_penalties for st in states)


@dataclass
class _SampledRows:
    """The rows of a batch that sample (temperature > 0) and their parameters."""

    #: ascending row numbers
    indices: list[int]
    #: ``indices`` on the device; None when every row samples
    idx: torch.Tensor | None
    #: the sampled rows' parameters, in ``indices`` order
    row_params: SamplingTensors

    @classmethod
    def of(
        cls, states: Sequence[RowState], row_params: SamplingTensors | None, device: torch.device
    ) -> _SampledRows | None:
        indices = [i for i, st in enumerate(states) if not st.params.is_greedy]
        if not indices:
            return None
        idx = None if len(indices) == len(states) else to_device(indices, torch.long, device)
        if row_params is None:
            row_params = SamplingTensors.from_params([states[i].params for i in indices], device)
        elif idx is not None:
            row_params = row_params.select(idx)
        return cls(indices, idx, row_params)

    def take(self, rows: torch.Tensor) -> torch.Tensor:
        return rows if self.idx is None else rows.index_select(0, self.idx)


class Sampler:
    def __init__(
        self,
        generator: torch.Generator,
        logprobs_mode: str = "raw_logprobs",
        native: SamplingKernels | None = None,
    ) -> None:
        #: draws noise for rows without their own generator
        self.generator = generator
        self.logprobs_mode = logprobs_mode
        #: steps 3-5 in C for float32 CPU logits (``engine/native/sampling.c``); None: tensor ops only
        self.native = native
        #: the grammar-mask stage of every step, with its cost counters
        self.grammar_masks = GrammarMasks()

    def distributions(
        self, logits: torch.Tensor, states: Sequence[RowState], row_params: SamplingTensors | None = None
    ) -> Distributions:
        """Steps 1-4 of the pipeline for every row of ``logits`` [N, V]: what each row is drawn from (or,
        for greedy rows, the argmax of), without drawing. Speculative verification scores drafts with it."""
        proc, dead = self._constrained(logits, states)
        dist = self._truncated(proc, states, row_params)
        dist.dead = dead
        return dist

    def _truncated(
        self, proc: torch.Tensor, states: Sequence[RowState], row_params: SamplingTensors | None
    ) -> Distributions:
        """Steps 3-4 on ``proc``, the rows' logits after steps 1-2."""
        rows = _SampledRows.of(states, row_params, proc.device)
        if rows is None:
            return Distributions(proc, [], None, None)
        row_params, pick = rows.row_params, [states[i].params for i in rows.indices]
        plan = FilterRows.of(pick, proc.shape[-1], proc.device)
        temps = row_params.temperature.unsqueeze(1)
        scaled = rows.take(proc) / temps.clamp(min=NEAR_ZERO_TEMPERATURE)
        if plan.near_zero_temperature:
            # the T -> 0 limit: all mass on the maximal logits, split evenly between ties
            at_max = scaled == scaled.max(dim=-1, keepdim=True).values
            limit = torch.zeros_like(scaled).masked_fill_(~at_max, float("-inf"))
            scaled = torch.where(temps < NEAR_ZERO_TEMPERATURE, limit, scaled)
        if plan.use_min_p:
            apply_min_p(scaled, row_params.min_p, plan.min_p_rows)
        if plan.use_top_k:
            apply_top_k(scaled, row_params.top_k, plan.top_k_rows, plan.top_k_max)
        if plan.use_top_p:
            apply_top_p(scaled, row_params.top_p, plan.top_p_rows)
        if plan.use_typical_p:
            apply_typical_p(scaled, row_params.typical_p, plan.typical_p_rows)
        return Distributions(proc, rows.indices, rows.idx, scaled)

    def _constrained(
        self, logits: torch.Tensor, states: Sequence[RowState]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Steps 1-2: ``logits`` itself when no row has constraints or penalties, else a changed copy; and
        with constraints the rows they leave without any token (``Distributions.dead``), which are
        zeroed so that every later step has a distribution to work on (their draw is then replaced)."""
        need_constraints, need_penalties = _stages_needed(states)
        proc = logits.clone() if (need_constraints or need_penalties) else logits
        dead = None
        if need_constraints:
            apply_constraints(proc, states, self.grammar_masks)
            # masks only remove tokens, so a row with none left is all -inf (nothing later can add one);
            # finding it costs a max per row and no host sync
            dead = proc.amax(dim=-1) == NEG_INF
            _fill_rows(proc, dead, 0.0)
        if need_penalties:
            apply_penalties(proc, states)
        return proc, dead

    def sample(
        self,
        logits: torch.Tensor,
        states: Sequence[RowState],
        *,
        want_sampled_logprob: Sequence[bool] = (),
        want_full: Sequence[bool] = (),
        row_params: SamplingTensors | None = None,
    ) -> SamplerOutput:
        """One token per row of ``logits`` [N, V] (float32). ``want_sampled_logprob[i]`` asks for the sampled
        token's logprob (cumulative scores of parallel samples); ``want_full[i]`` for the whole row.
        ``row_params``: the rows' parameters as tensors (built from ``states`` when not given)."""
        n = logits.shape[0]
        want_lp = [
            st.params.logprobs is not None or (want_sampled_logprob[i] if want_sampled_logprob else False)
            for i, st in enumerate(states)
        ]
        want_full = list(want_full) or [False] * n
        need_constraints, need_penalties = _stages_needed(states)
        greedy = [st.params.is_greedy for st in states]
        if all(greedy) and not (need_constraints or need_penalties or any(want_lp) or any(want_full)):
            return SamplerOutput(logits.argmax(dim=-1).tolist(), [None] * n, [None] * n, {})

        raw_lp = logits.log_softmax(dim=-1) if self.logprobs_mode == "raw_logprobs" and any(want_lp) else None
        # the kernel gives tokens only: not for rows that report or score the processed distribution
        needs_processed = (raw_lp is None and any(want_lp)) or any(want_full)
        if not needs_processed and (native := self._draw_natively(logits, states, row_params)) is not None:
            return sampler_output(native.tolist(), states, want_lp, want_full, raw_lp, None)
        dist = self.distributions(logits, states, row_params)
        tokens = self._draw(dist, states)
        final = dist.proc  # the distribution each row is drawn from (greedy rows: the constrained logits)
        if dist.scaled is not None and (any(want_lp) or any(want_full)):
            final = dist.drawn_from()
        proc_lp = final.log_softmax(dim=-1) if needs_processed else None
        if proc_lp is not None and dist.dead is not None:
            _fill_rows(proc_lp, dist.dead, NEG_INF)  # no token is possible there: a beam ends
        return sampler_output(tokens.tolist(), states, want_lp, want_full, raw_lp, proc_lp)

    def sample_tokens(
        self, logits: torch.Tensor, states: Sequence[RowState], row_params: SamplingTensors | None = None
    ) -> torch.Tensor:
        """One token per row of ``logits`` [N, V], as ``sample`` draws it, left on the logits' device (int64
        [N]) with no host sync: asynchronous scheduling reads them there. For rows that want no logprobs."""
        need_constraints, need_penalties = _stages_needed(states)
        if all(st.params.is_greedy for st in states) and not (need_constraints or need_penalties):
            return logits.argmax(dim=-1)
        native = self._draw_natively(logits, states, row_params)
        return (
            native
            if native is not None
            else self._draw(self.distributions(logits, states, row_params), states)
        )

    def _draw(self, dist: Distributions, states: Sequence[RowState]) -> torch.Tensor:
        """Step 5: each row's token (greedy rows the argmax of their constrained logits), on the device."""
        tokens = None if dist.every_row_samples else dist.proc.argmax(dim=-1)
        if dist.scaled is not None:
            probs = dist.scaled.softmax(dim=-1)
            # one uniform per row (``draw.py``); a seeded row takes its own from its generator
            gens = [states[i].generator for i in dist.sample_rows]
            uniform = uniform_numbers(gens, 1, self.generator, probs.device)[:, 0]
            drawn = inverse_cdf_draw(probs, uniform)
            if dist.idx is None:
                tokens = drawn
            else:
                assert tokens is not None  # argmax of every row, greedy rows kept
                tokens.index_copy_(0, dist.idx, drawn)
        assert tokens is not None  # every row is greedy or sampled
        return _no_token_where(dist.dead, tokens)

    def _draw_natively(
        self, logits: torch.Tensor, states: Sequence[RowState], row_params: SamplingTensors | None
    ) -> torch.Tensor | None:
        """Every row's token with steps 3-5 of the sampled rows in the C kernel, or None where the kernel
        does not apply (no kernel, not float32 CPU logits, no sampled row). Rows with typical-p or a
        near-zero temperature, which the kernel does not take, are truncated by the tensor pipeline and
        drawn with the same uniform numbers, drawn once for all rows as the tensor path draws them."""
        if self.native is None or logits.device.type != "cpu" or logits.dtype != torch.float32:
            return None
        rows = _SampledRows.of(states, row_params, logits.device)
        if rows is None:
            return None
        proc, dead = self._constrained(logits, states)
        gens = [states[i].generator for i in rows.indices]
        uniform = uniform_numbers(gens, 1, self.generator, logits.device)[:, 0]
        sampled, values = rows.take(proc), rows.row_params.values
        rest = [
            j
            for j, i in enumerate(rows.indices)
            if states[i].params.typical_p < 1.0 or states[i].params.temperature < NEAR_ZERO_TEMPERATURE
        ]
        if not rest:
            drawn = self.native.draw(sampled.contiguous(), values.contiguous(), uniform)
        else:
            drawn = torch.empty(len(rows.indices), dtype=torch.long)
            tensor_rows = set(rest)
            kernel = [j for j in range(len(rows.indices)) if j not in tensor_rows]
            if kernel:
                k = torch.tensor(kernel)
                drawn[k] = self.native.draw(
                    sampled[k].contiguous(), values[k].contiguous(), uniform[k].contiguous()
                )
            t = torch.tensor(rest)
            dist = self._truncated(
                sampled[t], [states[rows.indices[j]] for j in rest], SamplingTensors(values[t])
            )
            assert dist.scaled is not None  # every one of these rows samples
            drawn[t] = inverse_cdf_draw(dist.scaled.softmax(dim=-1), uniform[t])
        if rows.idx is None:
            return _no_token_where(dead, drawn)
        tokens = proc.argmax(dim=-1)
        tokens.index_copy_(0, rows.idx, drawn)
        return _no_token_where(dead, tokens)


def _fill_rows(t: torch.Tensor, rows: torch.Tensor, value: float) -> None:
    """In place: ``value`` in every entry of the rows ``rows`` ([N] bool, on ``t``'s device) marks. Off
    the CPU one sync-free pass; on the CPU (where asking costs nothing, and a broadcast fill ~2 ms at
    64 x 49k) only when a row is marked."""
    if t.device.type != "cpu":
        t.masked_fill_(rows.unsqueeze(1), value)
    elif bool(rows.any()):
        t[rows] = value


def _no_token_where(dead: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor:
    """``tokens`` with ``NO_TOKEN`` on the rows no token was possible for (on the device, no sync)."""
    return tokens if dead is None else tokens.masked_fill(dead, NO_TOKEN)
