"""The comparison's workload and load plan, identical for every system, and the ``bench serve`` flags.

Every server is driven with the same ``kvpilot bench serve`` arguments (same seed, prompts, arrivals),
greedy, a fixed output length with ``ignore_eos``:
- closed loop: one ``bench serve`` run per concurrency level, so each level gets its own request count
  (a level of c clients sends ``max(min_requests, rounds_per_client × c)``). A level's seed is
  ``seed + its index``: fresh prompts per level, because prompts repeated from an earlier level would be
  served from the prefix cache and flatter the later level (vLLM caches prefixes by default).
- open loop: one ``bench serve`` rate sweep (that tool already gives each rate fresh prompts and the
  same arrival pattern rescaled), seeded ``seed + OPEN_LOOP_SEED_OFFSET``.
HF ``generate`` at batch b runs exactly the first b measured prompts of closed-loop level ``b``.

For SmolLM2's tokenizer one generated word is exactly one token, so ``input_len`` is in tokens too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from kvpilot.bench.config import length_range_error

OPEN_LOOP_SEED_OFFSET = 100  # keeps the open-loop prompts apart from every closed-loop level's


class PlanError(ValueError):
    """A plan value that cannot work; the message names the flag."""


@dataclass(frozen=True)
class ComparePlan:
    seed: int = 0
    input_len: tuple[int, int] = (64, 128)  # prompt length, tokens, uniform inclusive
    output_len: int = 64  # max_tokens for every request, exact (ignore_eos)
    concurrencies: tuple[int, ...] = (1, 8, 32)  # closed-loop clients; also the HF batch sizes
    # Open-loop sweep, req/s, geometric: at 64 output tokens a server here serves ~0.3-3 req/s, so the
    # sweep brackets the knee of either server.
    request_rates: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)
    min_requests: int = 16  # closed loop: measured requests per level at least
    rounds_per_client: int = 2  # closed loop: measured requests per client at least
    open_requests: int = 24  # open loop: measured requests per rate
    warmup_requests: int = 2  # per bench serve run, sent one at a time first and excluded
    request_timeout_s: float = 300.0  # one request, end to end

    def validate(self) -> None:
        if self.seed < 0:
            raise PlanError(f"--seed must be >= 0 (got {self.seed})")
        if error := length_range_error("--input-len", self.input_len):
            raise PlanError(error)
        if self.output_len < 2:
            raise PlanError(f"--output-len must be >= 2 so TPOT is defined (got {self.output_len})")
        if not self.concurrencies:
            raise PlanError("--concurrency needs at least one level")
        if any(level < 1 for level in self.concurrencies):
            raise PlanError(f"--concurrency levels must be >= 1 (got {self.concurrencies})")
        if len(set(self.concurrencies)) != len(self.concurrencies):
            raise PlanError(f"--concurrency lists a level twice (got {self.concurrencies})")
        if any(not (rate > 0 and math.isfinite(rate)) for rate in self.request_rates):
            raise PlanError(f"--request-rate values must be positive and finite (got {self.request_rates})")
        if len(set(self.request_rates)) != len(self.request_rates):
            raise PlanError(f"--request-rate lists a rate twice (got {self.request_rates})")
        for flag, value in (
            ("--min-requests", self.min_requests),
            ("--rounds-per-client", self.rounds_per_client),
            ("--open-requests", self.open_requests),
        ):
            if value < 1:
                raise PlanError(f"{flag} must be >= 1 (got {value})")
        if self.warmup_requests < 1:
            # Without warm-up the first measured request pays the cold start that must be reported apart.
            raise PlanError(f"--warmup-requests must be >= 1 (got {self.warmup_requests})")
        if not (self.request_timeout_s > 0 and math.isfinite(self.request_timeout_s)):
            raise PlanError(
                f"--request-timeout must be a positive number of seconds (got {self.request_timeout_s})"
            )

    @property
    def levels(self) -> tuple[int, ...]:
        return tuple(sorted(self.concurrencies))

    @property
    def rates(self) -> tuple[float, ...]:
        return tuple(sorted(self.request_rates))

    def closed_requests(self, concurrency: int) -> int:
        return max(self.min_requests, self.rounds_per_client * concurrency)

    def closed_seed(self, concurrency: int) -> int:
        return self.seed + self.levels.index(concurrency)

    @property
    def open_seed(self) -> int:
        return self.seed + OPEN_LOOP_SEED_OFFSET

    def _common_args(self, base_url: str) -> list[str]:
        return [
            "--base-url",
            base_url,
            "--api",
            "completions",
            "--input-len",
            f"{self.input_len[0]}:{self.input_len[1]}",
            "--output-len",
            f"{self.output_len}:{self.output_len}",
            "--ignore-eos",
            "--temperature",
            "0",
            "--warmup-requests",
            str(self.warmup_requests),
            "--request-timeout",
            f"{self.request_timeout_s:g}",
            "--no-progress",
            # every system must get the same requests (HF generate runs them too): a context too small for
            # them is a failed run (bench serve exits 3), not a workload scaled for that system alone
            "--no-context-fit",
        ]

    def closed_loop_args(
        self, base_url: str, concurrency: int, output_json: Path, plot_dir: Path | None = None
    ) -> list[str]:
        """``bench serve`` flags for one closed-loop level."""
        args = [
            *self._common_args(base_url),
            "--concurrency",
            str(concurrency),
            "--num-requests",
            str(self.closed_requests(concurrency)),
            "--seed",
            str(self.closed_seed(concurrency)),
            "--output-json",
            str(output_json),
        ]
        if plot_dir is not None:
            args += ["--plot-dir", str(plot_dir)]
        return args

    def open_loop_args(self, base_url: str, output_json: Path, plot_dir: Path | None = None) -> list[str]:
        """``bench serve`` flags for the open-loop rate sweep (Poisson arrivals)."""
        args = [
            *self._common_args(base_url),
            "--request-rate",
            ",".join(f"{rate:g}" for rate in self.rates),
            "--num-requests",
            str(self.open_requests),
            "--seed",
            str(self.open_seed),
            "--output-json",
            str(output_json),
        ]
        if plot_dir is not None:
            args += ["--plot-dir", str(plot_dir)]
        return args

    def hf_prompts(self, batch: int) -> list[str]:
        """The prompts HF ``generate`` runs at batch ``batch``: the first ``batch`` measured prompts of
        closed-loop level ``batch``, exactly as ``bench serve`` draws them.

        ``kvpilot.bench.runner`` splits ``SeedSequence(seed)`` into (arrivals, tenants, warm-up, requests)
        and the requests seed into one child per load point; a closed-loop level is a run's only point.
        A test checks this against what a server receives, so a change in that split shows up there.
        """
        import numpy as np

        from kvpilot.bench.config import WorkloadConfig
        from kvpilot.bench.workloads import Workload

        request_root = np.random.SeedSequence(self.closed_seed(batch)).spawn(4)[3]
        workload = Workload(
            WorkloadConfig(
                kind="random",
                input_len_range=self.input_len,
                output_len_range=(self.output_len, self.output_len),
            )
        )
        stream = workload.stream(np.random.default_rng(request_root.spawn(1)[0]))
        return [next(stream).prompt for _ in range(batch)]
