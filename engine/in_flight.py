"""Asynchronous scheduling's tokens in flight (docs/architecture.md#asynchronous-scheduling).

With ``async_scheduling`` the engine schedules and launches step N+1 before the host has seen the tokens
step N sampled. ``InFlightTokens`` holds them: on the device, where step N+1's inputs are copied from
(``InputBatch.build`` reads ``Sequence.pending_row``), and on their way to the host in one non-blocking
copy into a pinned buffer, read (``host_ids``) only once step N+1's forward is launched. So appending,
detokenizing and the stop checks of step N run while the device computes step N+1, and the host never
waits for a forward it could overlap.
"""

from __future__ import annotations

import torch

from kvpilot.engine.sequence import Sequence


class TokenCopy:
    """The device → host copy of each step's sampled ids, through one pinned buffer reused every step: the
    host has read one step's ids before the next step's copy is issued, so one buffer is enough."""

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._host: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def start(self, ids: torch.Tensor) -> torch.Tensor:
        """Issue the copy of ``ids`` (int64 [N]); the host tensor it lands in (read after ``wait``)."""
        if not self.pinned:
            return ids  # on the CPU the ids are on the host already (the forward has run)
        n = ids.numel()
        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 256), dtype=torch.int64, pin_memory=True)
        host = self._host[:n]
        host.copy_(ids, non_blocking=True)
        if self._copied is None:
            self._copied = torch.cuda.Event()
        self._copied.record()
        return host

    def wait(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()


class InFlightTokens:
    """The tokens one step sampled, one per sequence of ``seqs`` (row i is ``seqs[i]``'s), not yet appended.
    Each sequence's ``pending_row`` points at its row until ``take`` hands the tokens to the host."""

    def __init__(self, seqs: list[Sequence], ids: torch.Tensor, copy: TokenCopy) -> None:
        self.seqs = seqs
        #: the sampled ids on the device, int64 [len(seqs)]
        self.ids = ids
        self._copy = copy
        self._host = copy.start(ids)
        for row, seq in enumerate(seqs):
            seq.pending_row = row

    def take(self) -> list[tuple[Sequence, int]]:
        """Wait for the copy and return (sequence, token) per row; the sequences have no token in flight
        after it (one that ended meanwhile, by an abort or a deadline, is the caller's to skip)."""
        self._copy.wait()
        tokens = self._host.tolist()
        for seq in self.seqs:
            seq.pending_row = None
        return list(zip(self.seqs, tokens, strict=True))
