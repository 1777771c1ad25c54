"""The token bitmask: which tokens each constrained row may take next (docs/architecture.md#sampling-pipeline,
step 1, and docs/architecture.md#structured-outputs).

A mask is int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is legal (llguidance's
layout). ``GrammarMasks.apply`` fills the rows of every constrained sequence in one llguidance call (its
own worker threads, the GIL released) into a host buffer (pinned on CUDA), copies it to the logits'
device without waiting, and there turns the bits into −inf on the illegal tokens of those rows only: a
few whole-tensor ops, no loop over the vocabulary and no read back to the host.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import torch

from kvpilot.engine.structured.matcher import GrammarMatcher

WORD_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words → [R, vocab_size] bool (True = legal), on the bitmask's device."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set the illegal tokens of ``logits[rows]`` to −inf in place (``rows`` None: every row, in order).
    ``bitmask`` [len(rows), W] may live on the host; it is copied to the logits' device."""
    legal = unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])
    if rows is None:
        logits.masked_fill_(~legal, float("-inf"))
        return
    picked = logits.index_select(0, rows).masked_fill_(~legal, float("-inf"))
    logits.index_copy_(0, rows, picked)


class GrammarMasks:
    """Fills and applies the masks of a batch's constrained rows; counts what that costs."""

    def __init__(self, threads: int | None = None) -> None:
        self._executor = llguidance.LLExecutor(threads)
        #: constrained rows masked, and the seconds filling and applying their masks took
        self.rows = 0
        self.seconds = 0.0

    def fill(self, matchers: Sequence[GrammarMatcher], vocab_size: int, pin: bool = False) -> torch.Tensor:
        """A host bitmask [len(matchers), W] with each matcher's legal next tokens."""
        bitmask = torch.empty((len(matchers), bitmask_width(vocab_size)), dtype=torch.int32, pin_memory=pin)
        self._executor.unsafe_compute_mask_ptr(
            [(m.ll, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(),
            bitmask.shape[1] * bitmask.element_size(),
            len(matchers),
        )
        return bitmask

    def apply(self, logits: torch.Tensor, rows: Sequence[int], matchers: Sequence[GrammarMatcher]) -> None:
        """−inf on the tokens ``matchers[i]`` forbids in ``logits[rows[i]]``."""
        start = time.perf_counter()
        bitmask = self.fill(matchers, logits.shape[1], pin=logits.device.type == "cuda")
        index = None if len(rows) == logits.shape[0] else torch.tensor(rows, device=logits.device)
        apply_token_bitmask_(logits, bitmask, index)
        self.rows += len(rows)
        self.seconds += time.perf_counter() - start
