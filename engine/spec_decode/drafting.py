"""Each step's drafts (docs/architecture.md#speculative-decoding): which decoding sequences speculate, and how
many tokens each may propose.

A sequence drafts when its next step would be a one-token decode, it is not a beam (beam search scores every
candidate itself) and it does not ban repeated n-grams (that ban's index only covers committed tokens). The
draft is cut so that, with the bonus token, it cannot pass ``max_tokens`` or the context, and to the prefix
its grammar accepts (structured outputs). A step whose batch has more decoding sequences than
``disable_by_batch_size`` drafts nothing: the forward is then compute-bound and verifying costs what it saves.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.engine.request import Request, RequestStatus
from kvpilot.engine.spec_decode.config import SpeculativeConfig
from kvpilot.engine.spec_decode.ngram_proposer import propose


def draft_limit(seq: Request, max_model_len: int) -> int:
    """Most draft tokens ``seq`` may propose now: room for them and the bonus token."""
    room = max_model_len - seq.num_tokens - 1
    max_tokens = seq.params.max_tokens
    if max_tokens is not None:
        room = min(room, max_tokens - seq.num_output_tokens - 1)
    return max(0, room)


def can_speculate(seq: Request) -> bool:
    group = seq.group
    return (
        seq.status is RequestStatus.DECODE
        and not seq.paused
        and seq.num_tokens - seq.num_computed_tokens == 1
        and seq.num_output_tokens > 0
        and (group is None or group.beam is None)
        and not seq.params.no_repeat_ngram_size
    )


def propose_drafts(running: Iterable[Request], config: SpeculativeConfig, max_model_len: int) -> int:
    """Set ``spec_token_ids`` of every running sequence for this step; returns the draft tokens proposed."""
    running = list(running)
    decoding = [s for s in running if can_speculate(s)]
    for seq in running:
        seq.spec_token_ids = []
    if len(decoding) > config.disable_by_batch_size:
        return 0
    total = 0
    for seq in decoding:
        limit = draft_limit(seq, max_model_len)
        if limit <= 0:
            continue
        drafts = propose(seq.all_token_ids, config.ngram, limit)
        if drafts and seq.grammar is not None:
            drafts = drafts[: seq.grammar.valid_prefix(drafts)]
        seq.spec_token_ids = drafts
        total += len(drafts)
    return total
