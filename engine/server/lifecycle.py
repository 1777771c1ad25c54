"""The server's phase (``/ready``'s truth) and its startup timings
(docs/architecture.md#readiness-and-warm-up: cold start is not steady state).

loading → warming_up → ready, then draining after SIGTERM; ``failed`` when loading or the engine loop
broke. Draining and failed are final: a late ``enter(READY)`` from the engine thread cannot undo a drain
that began during warm-up. Written by the engine thread and the drain task, read by HTTP handlers: every
access holds one lock, and readers get immutable snapshots.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class Phase(str, enum.Enum):
    LOADING = "loading"
    WARMING_UP = "warming_up"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"


_FINAL = (Phase.DRAINING, Phase.FAILED)


@dataclass(frozen=True)
class PhaseSnapshot:
    phase: Phase
    #: steps done / total of the current phase (warm-up buckets); total 0 = not measurable (loading)
    done: int
    total: int
    detail: str
    #: seconds each finished startup phase took
    startup_seconds: dict[str, float]

    @property
    def ready(self) -> bool:
        return self.phase is Phase.READY

    def to_json(self) -> dict:
        fraction = 1.0 if self.phase is Phase.READY else (self.done / self.total if self.total else 0.0)
        return {
            "phase": self.phase.value,
            "ready": self.ready,
            "progress": {"done": self.done, "total": self.total, "fraction": round(fraction, 4)},
            "detail": self.detail,
            "startup_seconds": dict(self.startup_seconds),
        }


class Lifecycle:
    def __init__(
        self,
        on_phase_timed: Callable[[str, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._lock = threading.Lock()
        self._clock = clock
        self._on_phase_timed = on_phase_timed
        self._phase = Phase.LOADING
        self._phase_started = clock()
        self._done = 0
        self._total = 0
        self._detail = "loading the model and allocating the KV cache"
        self._startup: dict[str, float] = {}

    def enter(self, phase: Phase, total: int = 0, detail: str = "") -> bool:
        """Move to ``phase`` (False, and nothing changes, once draining or failed). Leaving loading or
        warming_up records how long it took."""
        with self._lock:
            if self._phase in _FINAL and phase is not Phase.FAILED:
                return False
            now = self._clock()
            timed = None
            if self._phase in (Phase.LOADING, Phase.WARMING_UP) and phase is not self._phase:
                timed = (self._phase.value, now - self._phase_started)
                self._startup[timed[0]] = timed[1]
            self._phase, self._phase_started = phase, now
            self._done, self._total, self._detail = 0, total, detail
        if timed is not None and self._on_phase_timed is not None:
            self._on_phase_timed(*timed)
        return True

    def record(self, name: str, seconds: float) -> None:
        """A startup sub-phase measured by its runner (e.g. kernel tuning inside warming_up)."""
        with self._lock:
            self._startup[name] = seconds
        if self._on_phase_timed is not None:
            self._on_phase_timed(name, seconds)

    def advance(self, done: int, detail: str) -> None:
        with self._lock:
            self._done, self._detail = done, detail

    def fail(self, detail: str) -> None:
        self.enter(Phase.FAILED, detail=detail)

    @property
    def phase(self) -> Phase:
        with self._lock:
            return self._phase

    def snapshot(self) -> PhaseSnapshot:
        with self._lock:
            return PhaseSnapshot(self._phase, self._done, self._total, self._detail, dict(self._startup))
