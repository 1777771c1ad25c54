"""How long an engine may take to start, sized from the model (warm-up is not steady state:
docs/architecture.md#readiness-and-warm-up).

The startupProbe must outlast weight loading on the slowest node the model will land on, or Kubernetes
kills a healthy replica mid-load and it never comes up. So the budget is generous on purpose: weights
read at a pessimistic rate, times a safety factor, plus fixed time for process start and warm-up.
Readiness (`/ready`) then gates traffic separately, so a long budget never sends traffic to a cold pod.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpilot.operator.model_size import weight_bytes
from kvpilot.operator.spec import ModelSpec

PESSIMISTIC_LOAD_BYTES_PER_SECOND = 50 * 1024 * 1024  # a busy network volume, not a local NVMe
SAFETY_FACTOR = 3
FIXED_SECONDS = 120  # interpreter and CUDA start, tokenizer, warm-up passes
UNKNOWN_MODEL_SECONDS = 1800  # a path or PVC of unknown size: half an hour, overridable in the spec
PROBE_PERIOD_SECONDS = 10
# Rollouts have to wait for a new replica's whole start, and then some, before Kubernetes calls them stuck.
PROGRESS_DEADLINE_MARGIN_SECONDS = 300


@dataclass(frozen=True)
class StartupBudget:
    seconds: int

    @property
    def probe_failure_threshold(self) -> int:
        return math.ceil(self.seconds / PROBE_PERIOD_SECONDS)

    @property
    def progress_deadline_seconds(self) -> int:
        return self.seconds + PROGRESS_DEADLINE_MARGIN_SECONDS


def startup_budget(model: ModelSpec) -> StartupBudget:
    if model.startup_timeout_seconds is not None:
        return StartupBudget(model.startup_timeout_seconds)
    # `auto` is read as float32, the larger of what it resolves to: the budget does not know the device.
    weights = weight_bytes(model.source, "float32" if model.dtype == "auto" else model.dtype)
    if weights is None:
        return StartupBudget(UNKNOWN_MODEL_SECONDS)
    load_seconds = weights / PESSIMISTIC_LOAD_BYTES_PER_SECOND
    return StartupBudget(FIXED_SECONDS + math.ceil(SAFETY_FACTOR * load_seconds))
