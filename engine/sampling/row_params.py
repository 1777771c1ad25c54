"""Per-row sampling parameters as tensors, and which rows each truncation filter touches
(docs/architecture.md#sampling-pipeline).

``SamplingTensors`` holds temperature, min-p, top-k, top-p and typical-p as the columns of one float32
``[rows, 5]`` tensor on the logits' device. The engine gathers it per step from the persistent batch's
per-slot table (``engine/input_batch.py``: written once when a sequence takes its slot); other callers build
it from the parameters (``from_params``). top-k is stored as a float: every value below 2^24 is exact, and
larger ones are clamped to 2^24, which is off for any vocabulary this size or smaller.

``FilterRows`` is the host-side half, read from the parameters the host already has: the rows each filter
applies to (None: all of them) and the largest top-k, so the filters never ask the device which rows are
active — that question (``nonzero``) is a host sync on a GPU. Host lists reach a GPU through
``staging.to_device``: a copy from pageable memory would wait for everything queued on the device first.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpilot.engine.sampling.params import NEAR_ZERO_TEMPERATURE, SamplingParams
from kvpilot.engine.staging import to_device

#: the columns of ``SamplingTensors.values``, in order
COLUMNS = ("temperature", "min_p", "top_k", "top_p", "typical_p")
_TOP_K_LIMIT = 1 << 24


def param_row(p: SamplingParams) -> list[float]:
    """One row of ``SamplingTensors.values`` (``COLUMNS`` order)."""
    return [p.temperature, p.min_p, float(min(p.top_k, _TOP_K_LIMIT)), p.top_p, p.typical_p]


@dataclass
class SamplingTensors:
    #: float32 [rows, len(COLUMNS)]
    values: torch.Tensor

    @classmethod
    def from_params(cls, params: Sequence[SamplingParams], device: torch.device) -> SamplingTensors:
        return cls(to_device([param_row(p) for p in params], torch.float32, device))

    def select(self, rows: torch.Tensor) -> SamplingTensors:
        return SamplingTensors(self.values.index_select(0, rows))

    @property
    def temperature(self) -> torch.Tensor:
        return self.values[:, 0]

    @property
    def min_p(self) -> torch.Tensor:
        return self.values[:, 1]

    @property
    def top_k(self) -> torch.Tensor:
        return self.values[:, 2].long()

    @property
    def top_p(self) -> torch.Tensor:
        return self.values[:, 3]

    @property
    def typical_p(self) -> torch.Tensor:
        return self.values[:, 4]


def _rows(active: list[int], total: int, device: torch.device) -> torch.Tensor | None:
    return None if len(active) == total else to_device(active, torch.long, device)


@dataclass
class FilterRows:
    """For each filter: off (``use_*`` False), every row (``*_rows`` None) or the listed rows."""

    use_min_p: bool
    min_p_rows: torch.Tensor | None
    use_top_k: bool
    top_k_rows: torch.Tensor | None
    #: the largest active top-k (0 when top-k is off)
    top_k_max: int
    use_top_p: bool
    top_p_rows: torch.Tensor | None
    use_typical_p: bool
    typical_p_rows: torch.Tensor | None
    #: some row's temperature is in (0, NEAR_ZERO_TEMPERATURE): the T → 0 limit applies there
    near_zero_temperature: bool

    @classmethod
    def of(cls, params: Sequence[SamplingParams], vocab: int, device: torch.device) -> FilterRows:
        """In one pass over ``params`` (the rows in order)."""
        min_p: list[int] = []
        top_k: list[int] = []
        top_p: list[int] = []
        typical: list[int] = []
        k_max, near_zero = 0, False
        for i, p in enumerate(params):
            if p.min_p > 0:
                min_p.append(i)
            if 0 < p.top_k < vocab:
                top_k.append(i)
                k_max = max(k_max, p.top_k)
            if p.top_p < 1.0:
                top_p.append(i)
            if p.typical_p < 1.0:
                typical.append(i)
            near_zero = near_zero or p.temperature < NEAR_ZERO_TEMPERATURE
        n = len(params)
        return cls(
            bool(min_p),
            _rows(min_p, n, device) if min_p else None,
            bool(top_k),
            _rows(top_k, n, device) if top_k else None,
            k_max,
            bool(top_p),
            _rows(top_p, n, device) if top_p else None,
            bool(typical),
            _rows(typical, n, device) if typical else None,
            near_zero,
        )
