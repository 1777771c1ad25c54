"""Hard constraints and penalties, applied in the pipeline's fixed order (see ``sampler.py``):

grammar (structured outputs) → allowed_token_ids → logit_bias (±100) → bad_words → min_tokens →
no_repeat_ngram_size → repetition_penalty → frequency/presence penalties.

Masks set logits to -inf (constrained decoding is a mask, docs/architecture.md#sampling-pipeline). Penalties:
repetition is sign-aware (z/r if z > 0, z·r if z < 0) over tokens seen in prompt or output; frequency/presence
subtract ``α_f·c_i + α_p·1[c_i > 0]`` with c_i counted over generated tokens. Rows are processed only where
their parameter is active; penalties use batched count tensors. The grammar masks of all constrained rows
are filled and applied in one batch (``kvpilot.engine.structured.bitmask``,
docs/architecture.md#structured-outputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.staging import to_device
from kvpilot.engine.structured.bitmask import GrammarMasks
from kvpilot.engine.structured.matcher import GrammarMatcher

NEG_INF = float("-inf")


@dataclass
class RowState:
    """What the processors need to know about the sequence behind one row of logits."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: frozenset[int] = frozenset()
    #: banned token sequences (the tokenized ``bad_words``); a length-1 sequence bans a token everywhere
    bad_word_ids: Sequence[Sequence[int]] = ()
    #: (n-1)-gram → next tokens already generated after it, for ``no_repeat_ngram_size``
    ngram_index: dict[tuple[int, ...], set[int]] = field(default_factory=dict)
    generator: torch.Generator | None = None
    #: the sequence's place in its grammar (structured outputs); None = unconstrained
    grammar: GrammarMatcher | None = None
    #: draft tokens scored in the rows right after this one (speculative decoding): the grammar's masks
    #: of those rows are the matcher's after each draft (the rows themselves carry no ``grammar``)
    grammar_drafts: Sequence[int] = ()


def banned_by_bad_words(output: Sequence[int], banned: Sequence[Sequence[int]]) -> set[int]:
    """Tokens that would complete a banned sequence right now (sequence-aware)."""
    out: set[int] = set()
    for seq in banned:
        k = len(seq)
        if k == 1 or (len(output) >= k - 1 and list(output[len(output) - (k - 1) :]) == list(seq[:-1])):
            out.add(seq[-1])
    return out


def update_ngram_index(index: dict[tuple[int, ...], set[int]], output: Sequence[int], n: int) -> None:
    """Record the n-gram that ends at the newest output token (call once per appended token)."""
    if n >= 1 and len(output) >= n:
        index.setdefault(tuple(output[len(output) - n : len(output) - 1]), set()).add(output[-1])


def banned_by_ngrams(index: dict[tuple[int, ...], set[int]], output: Sequence[int], n: int) -> set[int]:
    if n < 1 or len(output) < n - 1:
        return set()
    return index.get(tuple(output[len(output) - (n - 1) :]) if n > 1 else (), set())


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    """[len(values), 1] float32 per-row factors on ``device``."""
    return to_device(values, torch.float32, device).unsqueeze(1)


def _counts(rows: list[int], id_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(rows), vocab] float counts of token ids per row (one batched scatter-add)."""
    width = max((len(ids) for ids in id_lists), default=0)
    host = np.full((len(rows), max(width, 1)), vocab, dtype=np.int64)  # padding counts in column vocab
    for i, ids in enumerate(id_lists):
        host[i, : len(ids)] = ids
    padded = to_device(host, torch.long, device)
    counts = torch.zeros(len(rows), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def apply_constraints(
    logits: torch.Tensor, states: Sequence[RowState], grammar_masks: GrammarMasks | None = None
) -> torch.Tensor:
    """Masks and biases, in order, in place on ``logits`` [N, V]. ``grammar_masks`` fills and applies the
    rows that have a grammar (one is made when not given)."""
    vocab = logits.shape[1]
    grammar_rows = [i for i, st in enumerate(states) if st.grammar is not None]
    if grammar_rows:
        masks = grammar_masks if grammar_masks is not None else GrammarMasks()
        with_grammar = [st for st in states if st.grammar is not None]
        masks.apply(
            logits,
            grammar_rows,
            [st.grammar for st in with_grammar if st.grammar is not None],
            [st.grammar_drafts for st in with_grammar],
        )
    mask_rows: list[int] = []
    mask_ids: list[int] = []
    for i, st in enumerate(states):
        p = st.params
        if p.allowed_token_ids is not None:
            allowed = torch.zeros(vocab, dtype=torch.bool, device=logits.device)
            allowed_ids = to_device([t for t in p.allowed_token_ids if t < vocab], torch.long, logits.device)
            allowed[allowed_ids] = True
            logits[i].masked_fill_(~allowed, NEG_INF)
        if p.logit_bias:
            bias = p.clamped_logit_bias
            ids = [t for t in bias if t < vocab]
            values = to_device([bias[t] for t in ids], logits.dtype, logits.device)
            logits[i].index_add_(0, to_device(ids, torch.long, logits.device), values)
        banned: set[int] = set()
        if st.bad_word_ids:
            banned |= banned_by_bad_words(st.output_token_ids, st.bad_word_ids)
        if len(st.output_token_ids) < p.min_tokens:
            banned |= set(st.eos_token_ids) | set(p.stop_token_ids)
        if p.no_repeat_ngram_size:
            banned |= banned_by_ngrams(st.ngram_index, st.output_token_ids, p.no_repeat_ngram_size)
        ids = [t for t in banned if 0 <= t < vocab]
        mask_rows += [i] * len(ids)
        mask_ids += ids
    if mask_ids:
        # every row's bad words, min_tokens and n-gram bans in one copy and one indexed write (they come
        # after the bias, which cannot revive a token they remove); per row it was a copy and a fill each
        at = to_device(np.array([mask_rows, mask_ids], dtype=np.int64), torch.long, logits.device)
        logits[at[0], at[1]] = NEG_INF
    return logits


def apply_penalties(logits: torch.Tensor, states: Sequence[RowState]) -> torch.Tensor:
    """Repetition (prompt + output) then frequency/presence (output), batched over the rows that use them."""
    vocab, dev = logits.shape[1], logits.device
    rep_rows = [i for i, st in enumerate(states) if st.params.repetition_penalty != 1.0]
    if rep_rows:
        seen = (
            _counts(
                rep_rows,
                [list(states[i].prompt_token_ids) + list(states[i].output_token_ids) for i in rep_rows],
                vocab,
                dev,
            )
            > 0
        )
        r = _column([states[i].params.repetition_penalty for i in rep_rows], dev)
        idx = to_device(rep_rows, torch.long, dev)
        z = logits.index_select(0, idx)
        penalised = torch.where(z > 0, z / r, z * r)
        logits.index_copy_(0, idx, torch.where(seen, penalised, z))
    fp_rows = [
        i
        for i, st in enumerate(states)
        if st.params.frequency_penalty != 0.0 or st.params.presence_penalty != 0.0
    ]
    if fp_rows:
        counts = _counts(fp_rows, [states[i].output_token_ids for i in fp_rows], vocab, dev)
        freq = _column([states[i].params.frequency_penalty for i in fp_rows], dev)
        pres = _column([states[i].params.presence_penalty for i in fp_rows], dev)
        idx = to_device(fp_rows, torch.long, dev)
        z = logits.index_select(0, idx)
        logits.index_copy_(0, idx, z - freq * counts - pres * (counts > 0).to(z.dtype))
    return logits
