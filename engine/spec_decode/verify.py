"""Verification of a step's drafts (docs/architecture.md#speculative-decoding): the target's logits at each
speculating sequence's last token and after each of its drafts go through the whole sampling pipeline
(constraints — the grammar's masks after each draft —, penalties counting the drafts before the row,
temperature, truncation), and the exact rule (``rejection.py``) keeps the accepted prefix plus one token.

Rows of one sequence are consecutive in ``logits``: row ``j`` is scored after its first ``j`` drafts. The
result comes back to the host in one transfer.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

import numpy as np
import torch

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.logits_processors import RowState
from kvpilot.engine.sampling.row_params import SamplingTensors
from kvpilot.engine.sampling.sampler import Distributions, Sampler
from kvpilot.engine.sampling.sampler_output import NO_TOKEN, top_logprobs_of
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.spec_decode.rejection import accept_greedy, accept_sampled


@dataclass
class VerifiedDraft:
    """What one speculating sequence emits this step."""

    #: the accepted drafts, then the target's own next token
    token_ids: list[int]
    #: per emitted token: its logprob (None where not requested) and top-N entries (None where not asked)
    logprobs: list[float | None]
    top_logprobs: list[dict[int, Logprob] | None]

    @property
    def num_accepted(self) -> int:
        return len(self.token_ids) - 1


def expanded_states(seq: Sequence, generator: torch.Generator | None) -> list[RowState]:
    """One ``RowState`` per verification row of ``seq``: row ``j`` sees the first ``j`` drafts as output
    (penalties, bad words and ``min_tokens`` count them); the grammar's masks for all rows come from the
    first row's matcher and the drafts."""
    drafts = seq.spec_token_ids
    rows = []
    for j in range(len(drafts) + 1):
        rows.append(
            RowState(
                seq.params,
                seq.prompt_token_ids,
                seq.output_token_ids if j == 0 else [*seq.output_token_ids, *drafts[:j]],
                seq.eos_token_ids,
                seq.bad_word_ids,
                seq.ngram_index,
                generator,
                seq.grammar if j == 0 else None,
                drafts if j == 0 and seq.grammar is not None else (),
            )
        )
    return rows


def verify_drafts(
    sampler: Sampler,
    logits: torch.Tensor,
    seqs: abc.Sequence[Sequence],
    generators: abc.Sequence[torch.Generator | None],
    row_params: SamplingTensors,
    want_logprobs: abc.Sequence[bool],
) -> list[VerifiedDraft]:
    """``logits`` [sum(1 + drafts), V]: each sequence's rows, consecutive. ``row_params`` one row per logits
    row. ``want_logprobs[i]``: sequence ``i`` reports its emitted tokens' logprobs."""
    states = [st for seq, gen in zip(seqs, generators, strict=True) for st in expanded_states(seq, gen)]
    num_drafts = np.asarray([len(s.spec_token_ids) for s in seqs], dtype=np.int64)
    offsets = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]])
    k = int(num_drafts.max())
    dev = logits.device
    # [B, k + 1] rows of each sequence (padding repeats its last row), drafts [B, k] (padding: 0, masked)
    rows = offsets[:, None] + np.minimum(np.arange(k + 1)[None, :], num_drafts[:, None])
    drafts = np.zeros((len(seqs), k), dtype=np.int64)
    for i, seq in enumerate(seqs):
        drafts[i, : num_drafts[i]] = seq.spec_token_ids
    dist = sampler.distributions(logits, states, row_params)
    greedy = np.asarray([s.params.is_greedy for s in seqs])
    tokens = torch.empty((len(seqs), k + 1), dtype=torch.long, device=dev)
    counts = torch.empty(len(seqs), dtype=torch.long, device=dev)
    rows_dev = torch.from_numpy(rows).to(dev)
    drafts_dev, nd_dev = torch.from_numpy(drafts).to(dev), torch.from_numpy(num_drafts).to(dev)
    g = np.flatnonzero(greedy)
    if g.size:
        gi = torch.from_numpy(g).to(dev)
        argmax = dist.proc.argmax(dim=-1)[rows_dev.index_select(0, gi)]
        t, c = accept_greedy(argmax, drafts_dev.index_select(0, gi), nd_dev.index_select(0, gi))
        tokens.index_copy_(0, gi, t)
        counts.index_copy_(0, gi, c)
    s = np.flatnonzero(~greedy)
    if s.size:
        assert dist.scaled is not None  # every sampled sequence's rows are sampled rows
        where = np.full(len(states), -1, dtype=np.int64)
        where[dist.sample_rows] = np.arange(len(dist.sample_rows))
        probs = dist.scaled.softmax(dim=-1)[torch.from_numpy(where[rows[s]]).to(dev)]  # [S, k + 1, V]
        uniforms = torch.rand(len(s), k + 1, generator=sampler.generator, device=dev)
        for j, row in enumerate(s.tolist()):
            gen = generators[row]
            if gen is not None:  # a seeded sequence draws exactly 1 + its drafts from its own generator
                own = torch.rand(int(num_drafts[row]) + 1, generator=gen, device=dev)
                uniforms[j, : num_drafts[row]] = own[:-1]
                uniforms[j, k] = own[-1]
        si = torch.from_numpy(s).to(dev)
        t, c = accept_sampled(
            probs,
            drafts_dev.index_select(0, si),
            nd_dev.index_select(0, si),
            _draft_probs([seqs[i] for i in s.tolist()], k, probs.shape[-1], dev),
            uniforms[:, :k],
            uniforms[:, k],
        )
        tokens.index_copy_(0, si, t)
        counts.index_copy_(0, si, c)
    if dist.dead is not None:
        _stop_at_dead_rows(tokens, counts, dist.dead[rows_dev])
    out_host = torch.cat([tokens, counts.unsqueeze(1)], dim=1).tolist()  # the one transfer
    results = []
    log_dist = _logprob_rows(sampler, logits, dist) if any(want_logprobs) else None
    for i, row in enumerate(out_host):
        emitted = row[: row[-1]]
        lps: list[float | None] = [None] * len(emitted)
        tops: list[dict[int, Logprob] | None] = [None] * len(emitted)
        if want_logprobs[i] and log_dist is not None:
            top_n = seqs[i].params.logprobs
            for j, tok in enumerate(emitted):
                if tok == NO_TOKEN:
                    break
                lp_row = log_dist[int(offsets[i]) + j]
                lps[j] = float(lp_row[tok])
                if top_n is not None:
                    tops[j] = top_logprobs_of(lp_row, tok, top_n)
        results.append(VerifiedDraft(emitted, lps, tops))
    return results


def _stop_at_dead_rows(tokens: torch.Tensor, counts: torch.Tensor, dead: torch.Tensor) -> None:
    """In place: a sequence whose emitted positions include one where its constraints leave no token
    (``dead`` [B, k + 1]) emits up to it and ``NO_TOKEN`` there (no draft is accepted at such a row, which
    the sampler zeroed), with no host sync."""
    emitted = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0) < counts.unsqueeze(1)
    hit = dead & emitted
    has = hit.any(dim=1)
    first = hit.to(torch.int8).argmax(dim=1)  # the first dead position (0 where none)
    counts.copy_(torch.where(has, first + 1, counts))
    at = first.unsqueeze(1)
    tokens.scatter_(1, at, torch.where(has.unsqueeze(1), NO_TOKEN, tokens.gather(1, at)))


def _draft_probs(seqs: abc.Sequence[Sequence], k: int, vocab: int, dev: torch.device) -> torch.Tensor | None:
    """[S, k, V] the distributions the drafts were drawn from (a deterministic proposal: one-hot), or
    None when every proposal is deterministic (the rule's one-hot case, without the tensor)."""
    if all(s.spec_draft_probs is None for s in seqs):
        return None
    q = torch.zeros((len(seqs), k, vocab), device=dev)
    for j, seq in enumerate(seqs):
        d = len(seq.spec_token_ids)
        if seq.spec_draft_probs is not None:
            q[j, :d] = seq.spec_draft_probs[:d]
        else:
            q[j, torch.arange(d), torch.tensor(seq.spec_token_ids)] = 1.0
    return q


def _logprob_rows(sampler: Sampler, logits: torch.Tensor, dist: Distributions) -> torch.Tensor:
    """The log-distribution logprobs report: the model's raw one, or the one each token was drawn from."""
    if sampler.logprobs_mode == "raw_logprobs":
        return logits.log_softmax(dim=-1)
    return dist.drawn_from().log_softmax(dim=-1)
