"""The token bitmask: which tokens each constrained row may take next (docs/architecture.md#sampling-pipeline,
step 1, and docs/architecture.md#structured-outputs).

A mask is int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` is legal (llguidance's
layout). ``GrammarMasks.apply`` fills the rows of every constrained sequence in one llguidance call (its
own worker threads, the GIL released) into a host buffer (pinned on CUDA), turns the bits into a bool
"illegal" mask on the logits' device and sets those tokens of those rows to −inf: whole-array ops, no
loop over the vocabulary and no read back to the host. On the CPU the bits are unpacked by numpy's
``unpackbits`` (the words' bytes in memory order, little-endian: byte ``t // 8``, bit ``t % 8``), ~50×
cheaper there than tensor shifts; on a GPU the words are copied without waiting and unpacked by shifts
on the device.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from kvpilot.engine.staging import to_device
from kvpilot.engine.structured.matcher import GrammarMatcher

WORD_BITS = 32


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + WORD_BITS - 1) // WORD_BITS


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 words → [R, vocab_size] bool (True = legal), by shifts on the bitmask's device."""
    shifts = torch.arange(WORD_BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


def illegal_tokens(bitmask: torch.Tensor, vocab_size: int, device: torch.device) -> torch.Tensor:
    """[R, vocab_size] bool on ``device``, True where the host ``bitmask`` [R, W] forbids the token."""
    if device.type == "cpu" and sys.byteorder == "little":
        words = bitmask.numpy().view(np.uint8)
        return torch.from_numpy(np.unpackbits(~words, axis=1, bitorder="little")[:, :vocab_size]).view(
            torch.bool
        )
    return ~unpack_bitmask(bitmask.to(device, non_blocking=True), vocab_size)


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Set the illegal tokens of ``logits[rows]`` to −inf in place (``rows`` None: every row, in order).
    ``bitmask`` [len(rows), W] lives on the host."""
    illegal = illegal_tokens(bitmask, logits.shape[1], logits.device)
    if rows is None:
        logits.masked_fill_(illegal, float("-inf"))
        return
    picked = logits.index_select(0, rows).masked_fill_(illegal, float("-inf"))
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

    def fill_with_drafts(
        self, matchers: Sequence[GrammarMatcher], drafts: Sequence[Sequence[int]], vocab_size: int, pin: bool
    ) -> torch.Tensor:
        """A host bitmask with ``1 + len(drafts[i])`` rows per matcher: its legal next tokens now and after
        each of its draft tokens (speculative decoding; llguidance advances and rolls the matcher back, so
        it ends where it started). The drafts must be ones the grammar accepts (``validate_tokens``)."""
        total = sum(1 + len(d) for d in drafts)
        bitmask = torch.zeros((total, bitmask_width(vocab_size)), dtype=torch.int32, pin_memory=pin)
        interpreters, offset = [], 0
        for m, d in zip(matchers, drafts, strict=True):
            interpreters.append((m.ll, offset, list(d)))
            offset += 1 + len(d)
        self._executor.unsafe_compute_mask_ptr_with_draft_token(
            interpreters, bitmask.data_ptr(), bitmask.shape[1] * bitmask.element_size(), total
        )
        return bitmask

    def apply(
        self,
        logits: torch.Tensor,
        rows: Sequence[int],
        matchers: Sequence[GrammarMatcher],
        drafts: Sequence[Sequence[int]] = (),
    ) -> None:
        """−inf on the tokens ``matchers[i]`` forbids in ``logits[rows[i]]`` (``rows`` ascending). With
        ``drafts``, row ``rows[i] + j`` gets the mask after the first ``j`` of ``drafts[i]`` (a draft's
        verification rows are consecutive)."""
        start = time.perf_counter()
        pin = logits.device.type == "cuda"
        if any(drafts):
            bitmask = self.fill_with_drafts(matchers, drafts, logits.shape[1], pin)
            rows = [r + j for r, d in zip(rows, drafts, strict=True) for j in range(1 + len(d))]
        else:
            bitmask = self.fill(matchers, logits.shape[1], pin=pin)
        index = None if len(rows) == logits.shape[0] else to_device(rows, torch.long, logits.device)
        apply_token_bitmask_(logits, bitmask, index)
        self.rows += len(rows)
        self.seconds += time.perf_counter() - start
