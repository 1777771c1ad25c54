"""What sampling a batch gives back (``SamplerOutput``): the tokens and, where a row asked for them, the
sampled token's logprob, the top-N logprobs with their ranks, and the whole log-distribution that beam
search scores (docs/architecture.md#sampling-pipeline)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.outputs import Logprob
from kvpilot.engine.sampling.logits_processors import RowState

#: the token a row gets when its constraints (allowed ids, bad words, min_tokens, n-grams, a grammar) leave
#: none: its sequence ends with finish reason "error" (``TokenAppender``) instead of taking a token the
#: constraints forbid
NO_TOKEN = -1


@dataclass
class SamplerOutput:
    token_ids: list[int]
    #: logprob of each sampled token under the reported distribution (None where not requested)
    sampled_logprobs: list[float | None]
    #: per row: {token_id: Logprob} for the top-N and the sampled token (None where not requested)
    top_logprobs: list[dict[int, Logprob] | None]
    #: per row that asked for it (``RowState``-parallel): the whole log-distribution, for beam search
    full_logprobs: dict[int, torch.Tensor]


def top_logprobs_of(logprobs: torch.Tensor, token: int, top_n: int) -> dict[int, Logprob]:
    """Top-``top_n`` entries of one log-distribution plus ``token``, each with its 1-based rank."""
    out: dict[int, Logprob] = {}
    if top_n > 0:
        values, ids = logprobs.topk(min(top_n, logprobs.shape[-1]))
        for rank, (v, t) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
            out[t] = Logprob(v, rank)
    if token not in out:
        lp = float(logprobs[token])
        out[token] = Logprob(lp, int((logprobs > lp).sum()) + 1)
    return out


def sampler_output(
    token_list: list[int],
    states: Sequence[RowState],
    want_lp: Sequence[bool],
    want_full: Sequence[bool],
    raw_lp: torch.Tensor | None,
    proc_lp: torch.Tensor | None,
) -> SamplerOutput:
    """The step's tokens with what each row asked for: the sampled token's logprob and the top-N under
    the reported distribution (``raw_lp`` where raw logprobs are on, else ``proc_lp``), and the whole
    processed log-distribution of rows that score beams."""
    n = len(token_list)
    sampled_lp: list[float | None] = [None] * n
    top: list[dict[int, Logprob] | None] = [None] * n
    full: dict[int, torch.Tensor] = {}
    for i, st in enumerate(states):
        if want_full[i]:
            assert proc_lp is not None  # computed whenever a row wants its full distribution
            full[i] = proc_lp[i]  # beam search scores the constrained, penalised distribution
        if want_lp[i] and token_list[i] != NO_TOKEN:
            if raw_lp is not None:
                row = raw_lp[i]
            else:
                assert proc_lp is not None  # computed when a row wants logprobs and raw ones are off
                row = proc_lp[i]
            sampled_lp[i] = float(row[token_list[i]])
            if st.params.logprobs is not None:
                top[i] = top_logprobs_of(row, token_list[i], st.params.logprobs)
    return SamplerOutput(token_list, sampled_lp, top, full)
