"""Beam search over live sequences (docs/architecture.md#parallel-samples-and-beams): keep the ``width`` best
partial sequences by cumulative log-probability; a finished hypothesis scores ``cum_logprob / len **
length_penalty`` (len = generated tokens). Beams are engine sequences that share KV blocks by reference count:
a beam that continues with several tokens is forked, a beam that continues with none is released.

Per step, each live beam proposes its ``2 × width`` best tokens; candidates are ranked by score (ties by
beam, then token id). An EOS (or ``stop_token_ids``) candidate among the top ``width`` becomes a finished
hypothesis; the first ``width`` other candidates continue. The search ends when no beam continues, when
``max_tokens`` is reached, or when ``width`` hypotheses are finished and no live beam's current normalised
score beats the worst of them (the usual ``early_stopping=False`` heuristic: pruning, so not guaranteed
globally optimal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.outputs import CompletionOutput

if TYPE_CHECKING:
    from kvpilot.engine.sampling.params import SamplingParams
    from kvpilot.engine.tokenizer import Tokenizer


def normalised_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """``cum_logprob / length ** length_penalty``; where that power leaves float range (a large or very
    negative penalty), the same quotient by logarithms, saturating at 0 and about -8e307: any penalty ranks
    without an overflow or a division by zero."""
    length = max(1, length)
    try:
        return cum_logprob / length**length_penalty
    except (OverflowError, ZeroDivisionError):
        if cum_logprob == 0.0:
            return 0.0
        magnitude = math.log(-cum_logprob) - length_penalty * math.log(length)
        return -math.exp(min(magnitude, 709.0))


@dataclass
class Hypothesis:
    tokens: list[int]
    cum_logprob: float
    finish_reason: str  # "stop" (EOS or a stop token), "length", or "error" (no token was possible)
    #: the stop token that ended it (``stop_token_ids``), else None
    stop_reason: int | None = None

    def score(self, length_penalty: float) -> float:
        return normalised_score(self.cum_logprob, len(self.tokens), length_penalty)


@dataclass
class Continuation:
    parent: str
    token: int
    cum_logprob: float


@dataclass
class BeamStep:
    """What the engine must do after a selection."""

    continue_with: list[Continuation]
    #: live beams that continue with no token: release them
    drop: list[str]
    done: bool


@dataclass
class BeamSearch:
    width: int
    length_penalty: float
    max_tokens: int
    eos_token_ids: frozenset[int]
    ignore_eos: bool = False
    #: tokens that end a hypothesis as EOS does (``stop_token_ids``), whatever ``ignore_eos`` says
    stop_token_ids: frozenset[int] = frozenset()
    #: live beam key → (its generated tokens, cumulative logprob)
    live: dict[str, tuple[list[int], float]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    done: bool = False
    #: next-token distributions the model computed for the search: one per live beam per step (its
    #: usage's generated tokens; forked beams copy their parent's tokens, so their lengths overcount)
    num_scored: int = 0

    def start(self, key: str) -> None:
        self.live[key] = ([], 0.0)

    def report(self, key: str, logprobs: torch.Tensor) -> bool:
        """Store one live beam's next-token log-distribution; True once every live beam has reported."""
        self.pending[key] = logprobs
        return set(self.pending) >= set(self.live)

    def select(self) -> BeamStep:
        self.num_scored += len(self.live)
        cands: list[tuple[float, int, int, str]] = []
        for order, (key, (toks, cum)) in enumerate(self.live.items()):
            values, ids = self.pending[key].topk(min(2 * self.width, self.pending[key].shape[-1]))
            finite = [
                (cum + v, order, t, key)
                for v, t in zip(values.tolist(), ids.tolist(), strict=True)
                if v != float("-inf")
            ]
            if not finite:  # its constraints leave it no token: it ends here, as a plain sample would
                self.finished.append(Hypothesis(list(toks), cum, "error"))
            cands += finite
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        chosen: list[Continuation] = []
        for rank, (score, _order, tok, key) in enumerate(cands):
            toks = self.live[key][0]
            stop_token = tok in self.stop_token_ids
            if stop_token or (tok in self.eos_token_ids and not self.ignore_eos):
                if rank < self.width:
                    self.finished.append(Hypothesis([*toks, tok], score, "stop", tok if stop_token else None))
                continue
            chosen.append(Continuation(key, tok, score))
            if len(chosen) == self.width:
                break
        new_len = len(next(iter(self.live.values()))[0]) + 1
        if new_len >= self.max_tokens:
            self.finished += [
                Hypothesis(self.live[c.parent][0] + [c.token], c.cum_logprob, "length") for c in chosen
            ]
            chosen = []
        if chosen and len(self.finished) >= self.width:
            worst_kept = sorted((h.score(self.length_penalty) for h in self.finished), reverse=True)[
                self.width - 1
            ]
            best_live = normalised_score(max(c.cum_logprob for c in chosen), new_len, self.length_penalty)
            if best_live <= worst_kept:
                chosen = []
        continuing = {c.parent for c in chosen}
        step = BeamStep(chosen, [k for k in self.live if k not in continuing], done=not chosen)
        self.pending.clear()
        self.done = step.done
        return step

    def rekey(self, new_live: dict[str, tuple[list[int], float]]) -> None:
        """The engine's beams after applying a step (keys may be new forked sequences)."""
        self.live = new_live

    def best(self, n: int) -> list[Hypothesis]:
        pool = list(self.finished)
        if len(pool) < n:  # stopped early (cancelled, context limit): fall back to live beams
            pool += [Hypothesis(toks, cum, "length") for toks, cum in self.live.values() if toks]
        return sorted(pool, key=lambda h: -h.score(self.length_penalty))[:n]

    def completions(self, n: int, tokenizer: Tokenizer, params: SamplingParams) -> list[CompletionOutput]:
        out = []
        for i, h in enumerate(self.best(n)):
            text = (
                tokenizer.decode(h.tokens, skip_special_tokens=params.skip_special_tokens)
                if params.detokenize
                else ""
            )
            reason, stop_reason = h.finish_reason, h.stop_reason  # type: str, str | int | None
            for stop in params.stop:
                pos = text.find(stop)
                if pos >= 0:
                    text = text[: pos + len(stop)] if params.include_stop_str_in_output else text[:pos]
                    reason, stop_reason = "stop", stop
                    break
            out.append(
                CompletionOutput(
                    index=i,
                    text=text,
                    token_ids=list(h.tokens),
                    cumulative_logprob=h.cum_logprob,
                    finish_reason=reason,
                    stop_reason=stop_reason,
                )
            )
        return out
