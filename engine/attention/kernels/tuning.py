"""Launch configurations for the attention kernels, and the tuner that picks one per served shape.

The best tile sizes and warp counts depend on the GPU and on the model's shape class (head_dim, GQA
group, cache dtype, block size), not on the batch, so the backend tunes once per shape class during
engine warm-up and every later step reuses the choice. Without tuning (and always in the interpreter)
the defaults below are used; they are valid on every supported shape.

Tuning here is explicit rather than ``triton.autotune``: the split-KV count is a host decision made
per step, the kernels must run in the interpreter where autotune would try to time on a GPU, and the
choice must be made before the engine reports ready, not on the first request that hits a new shape.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from triton.runtime.errors import OutOfResources

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KernelConfig:
    """One launch configuration. ``block_m`` (query rows per program) is used by prefill only."""

    tile_n: int
    num_warps: int
    num_stages: int
    block_m: int = 0

    def __post_init__(self) -> None:
        for name in ("tile_n", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a positive power of two, got {value}")
        if self.tile_n < 16:
            raise ValueError(f"tile_n must be >= 16 (tl.dot minimum), got {self.tile_n}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if self.block_m and (self.block_m < 16 or self.block_m & (self.block_m - 1)):
            raise ValueError(f"block_m must be 0 (unused) or a power of two >= 16, got {self.block_m}")


DECODE_DEFAULT = KernelConfig(tile_n=32, num_warps=4, num_stages=2)
PREFILL_DEFAULT = KernelConfig(tile_n=32, num_warps=4, num_stages=2, block_m=64)


def decode_candidates(head_dim: int) -> list[KernelConfig]:
    """Decode is bandwidth bound: vary how many keys one program streams per step and the pipelining."""
    tiles = (16, 32, 64) if head_dim >= 256 else (32, 64, 128)
    return [
        KernelConfig(tile_n=t, num_warps=w, num_stages=s) for t in tiles for w in (2, 4) for s in (1, 2, 3)
    ]


def prefill_candidates(head_dim: int) -> list[KernelConfig]:
    """Prefill is compute bound: vary the query/key tile. The fp32 accumulator is block_m x head_dim,
    so wide heads get shorter query tiles to stay in registers."""
    block_ms = (32, 64) if head_dim >= 256 else (64, 128)
    return [
        KernelConfig(tile_n=t, num_warps=w, num_stages=s, block_m=m)
        for m in block_ms
        for t in (32, 64)
        for w in (4, 8)
        for s in (1, 2)
    ]


class ConfigTable:
    """Chosen configurations per (kernel, shape key); falls back to the kernel's default."""

    def __init__(self) -> None:
        self._chosen: dict[tuple[str, tuple], KernelConfig] = {}

    def get(self, kernel: str, key: tuple, default: KernelConfig) -> KernelConfig:
        return self._chosen.get((kernel, key), default)

    def is_tuned(self, kernel: str, key: tuple) -> bool:
        return (kernel, key) in self._chosen

    def tune(
        self,
        kernel: str,
        key: tuple,
        candidates: Iterable[KernelConfig],
        run: Callable[[KernelConfig], None],
        measure: Callable[[Callable[[], None]], float],
    ) -> KernelConfig:
        """Time ``run(config)`` for every candidate with ``measure`` (seconds or ms, lower is better)
        and remember the fastest. Candidates the GPU cannot fit (shared memory, registers) are skipped."""
        timings: list[tuple[float, KernelConfig]] = []
        for config in candidates:
            try:
                elapsed = measure(functools.partial(run, config))
            except OutOfResources as exc:
                logger.debug("%s %s: %s skipped (%s)", kernel, key, config, exc)
                continue
            timings.append((elapsed, config))
        if not timings:
            raise RuntimeError(f"no launch configuration of {kernel} fits shape {key} on this device")
        best_time, best = min(timings, key=lambda pair: pair[0])
        logger.info("tuned %s %s: %s (%.4g)", kernel, key, best, best_time)
        self._chosen[(kernel, key)] = best
        return best
