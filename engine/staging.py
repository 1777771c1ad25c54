"""Host → device uploads of a step's index arrays through a pinned staging buffer
(docs/architecture.md#persistent-batch).

A step's inputs are built on the host as numpy arrays. On the CPU they become tensors without a copy
(``torch.from_numpy``). On another device, all arrays of one dtype are packed into one staging buffer —
page-locked when CUDA is available, so the copy is a real asynchronous DMA — and sent with one
``non_blocking=True`` copy; the results are views of one device tensor.

The staging buffer is reused every step, so it must not be overwritten while the previous copy out of it
may still be in flight: each upload records a CUDA event after its copy and the next one waits on that
event first. In the synchronous engine the step's sampled-token transfer has already waited for much more,
so the wait returns at once; it keeps the buffer safe once steps overlap (asynchronous scheduling).

``to_device`` is the one-off form for a short host list (row indices, per-row penalties): a copy from
pageable memory would wait for everything queued on the device first, ending the overlap.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, dtype: torch.dtype, size: int = 4096) -> None:
        self.device = device
        self.dtype = dtype
        self.direct = device.type == "cpu"
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._host: torch.Tensor | None = None
        self._host_np: np.ndarray | None = None
        self._done: torch.cuda.Event | None = None
        if not self.direct:
            self._allocate(size)

    def _allocate(self, size: int) -> None:
        self._host = torch.empty(size, dtype=self.dtype, pin_memory=self.pinned)
        self._host_np = self._host.numpy()

    def upload(self, *arrays: np.ndarray) -> list[torch.Tensor]:
        """Each array (1-D, of this stager's dtype) as a tensor on the device."""
        if self.direct:
            return [torch.from_numpy(a) for a in arrays]
        assert self._host is not None and self._host_np is not None
        total = sum(a.size for a in arrays)
        if self._done is not None:
            self._done.synchronize()  # the previous copy out of the staging buffer has finished
        if total > self._host.numel():
            self._allocate(max(total, 2 * self._host.numel()))
            assert self._host is not None and self._host_np is not None
        offsets = [0]
        for a in arrays:
            self._host_np[offsets[-1] : offsets[-1] + a.size] = a
            offsets.append(offsets[-1] + a.size)
        packed = self._host[:total].to(self.device, non_blocking=True)
        if self.pinned:
            if self._done is None:
                self._done = torch.cuda.Event()
            self._done.record()
        return [packed[s:e] for s, e in itertools.pairwise(offsets)]


def to_device(
    values: Sequence[int] | Sequence[float] | Sequence[Sequence[float]] | np.ndarray,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """A host list or array as a tensor on ``device``; on a GPU copied from page-locked memory without
    waiting (torch's pinned allocator keeps the buffer until the copy is done)."""
    host = (
        torch.from_numpy(values).to(dtype)
        if isinstance(values, np.ndarray)
        else torch.tensor(values, dtype=dtype)
    )
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
