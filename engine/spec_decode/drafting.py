"""Each step's drafts (docs/architecture.md#speculative-decoding): which decoding sequences speculate, and how
many tokens each may propose.

Prompt lookup proposes from the sequence's own tokens; a draft model (``draft_model.py``) runs ``k``
batched decode forwards over the speculating sequences, after their block tables have grown to hold the
positions it writes ahead.

A sequence drafts when its next step would be a one-token decode, it is not a beam (beam search scores
every candidate itself) and it does not ban repeated n-grams (that ban's index only covers committed
tokens). The draft is cut so that, with the bonus token, it cannot pass ``max_tokens`` or the context, and
to the prefix its grammar accepts (structured outputs). A step whose batch has more decoding sequences
than ``disable_by_batch_size`` drafts nothing: the forward is then compute-bound and verifying costs what
it saves.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.sequence import Sequence, SequenceStatus
from kvpilot.engine.spec_decode.config import SpeculativeConfig
from kvpilot.engine.spec_decode.ngram_proposer import propose

if TYPE_CHECKING:
    import torch

    from kvpilot.engine.kv.manager import KVCacheManager
    from kvpilot.engine.spec_decode.draft_model import DraftModel


def draft_limit(seq: Sequence, max_model_len: int) -> int:
    """Most draft tokens ``seq`` may propose now: room for them and the bonus token."""
    room = max_model_len - seq.num_tokens - 1
    max_tokens = seq.params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - seq.num_output_tokens - 1)
    return max(0, room)


def can_speculate(seq: Sequence) -> bool:
    group = seq.group
    return (
        seq.status is SequenceStatus.DECODE
        and not seq.paused
        and seq.num_tokens - seq.num_computed_tokens == 1
        and seq.num_output_tokens > 0
        and (group is None or group.beam is None)
        and not seq.params.no_repeat_ngram_size
    )


def propose_drafts(
    running: Iterable[Sequence],
    config: SpeculativeConfig,
    max_model_len: int,
    draft: DraftContext | None = None,
) -> int:
    """Set ``spec_token_ids`` of every running sequence for this step; returns the draft tokens proposed.
    ``draft``: the draft model and what it needs (method ``draft_model``)."""
    running = list(running)
    decoding = [s for s in running if can_speculate(s)]
    for seq in running:
        seq.spec_token_ids = []
        seq.spec_draft_probs = None
    if len(decoding) > config.disable_by_batch_size:
        return 0
    limits = [min(config.num_speculative_tokens, draft_limit(s, max_model_len)) for s in decoding]
    if draft is None:
        for seq, limit in zip(decoding, limits, strict=True):
            if limit > 0:
                seq.spec_token_ids = propose(seq.all_token_ids, config.ngram, limit)
    else:
        # the draft writes its K/V ahead of the last token: those slots must exist first (no preemption
        # for them: a sequence whose blocks cannot grow does not draft)
        chosen = [
            (s, n) for s, n in zip(decoding, limits, strict=True) if n > 0 and draft.kv.allocate(s, 1 + n)
        ]
        if chosen:
            seqs = [s for s, _ in chosen]
            assert draft.kv.block_tensor is not None  # the engine's KV manager keeps the batch's tables
            draft.model.propose(
                seqs,
                [n for _, n in chosen],
                draft.kv.block_tensor,
                [draft.generators.get(s.seq_id) for s in seqs],
                draft.generator,
            )
    total = 0
    for seq in decoding:
        if seq.spec_token_ids and seq.grammar is not None:
            keep = seq.grammar.valid_prefix(seq.spec_token_ids)
            seq.spec_token_ids = seq.spec_token_ids[:keep]
        total += len(seq.spec_token_ids)
    return total


@dataclass
class DraftContext:
    """What the ``draft_model`` proposer needs from the engine."""

    model: DraftModel
    kv: KVCacheManager
    #: seeded requests' generators by sequence id; the engine's for the rest
    generators: dict[str, torch.Generator]
    generator: torch.Generator
