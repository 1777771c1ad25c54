"""Applies the configured policy to the live replicas: builds scoring's inputs from replica state and hands
back the chosen replica with its decision.

Every replica's work is costed at one fleet-wide prefill rate (the median of the replicas' measured rates)
unless per-replica rates were asked for. Replicas of one service share model and hardware, and what makes
their measured rates differ is mostly the load they were measured under: an engine batching several prompts
into full chunks computes more tokens per second than one prefilling a single short prompt. Divided by its
own rate, the busiest replica looked the fastest, and in the three-replica benchmark the first nine tenants
all went to the replica that had served the first one, with two replicas idle. A slow replica still costs
more: its queue (``queued_prefill_tokens``) grows.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Sequence

from kvpilot.router.config import ScoringWeights
from kvpilot.router.replica import Replica
from kvpilot.router.request_profile import RequestProfile
from kvpilot.router.scoring import (
    FALLBACK,
    Candidate,
    Decision,
    RequestShape,
    choose_cache_aware,
    choose_least_loaded,
    choose_round_robin,
)


class ReplicaPicker:
    def __init__(
        self, policy: str, weights: ScoringWeights, prefill_rate_prior: float, per_replica_rate: bool = False
    ) -> None:
        self.policy = policy
        self.weights = weights
        self._prior = prefill_rate_prior
        self._per_replica_rate = per_replica_rate
        self._rotation = itertools.count()

    def fleet_prefill_rate(self, replicas: Sequence[Replica]) -> float:
        """Median of the replicas' known rates (peers share model and hardware), else the prior."""
        rates = [rate for rate in (r.rate.rate() for r in replicas) if rate]
        return statistics.median(rates) if rates else self._prior

    def prefill_rates(self, replicas: Sequence[Replica]) -> list[float]:
        """The rate each replica's work is costed at, in the order of ``replicas``."""
        fleet = self.fleet_prefill_rate(replicas)
        if not self._per_replica_rate:
            return [fleet] * len(replicas)
        return [r.rate.rate() or fleet for r in replicas]

    def pick(self, replicas: Sequence[Replica], profile: RequestProfile | None) -> tuple[Replica, Decision]:
        """Choose among routable ``replicas``; ``profile`` is None when the request's prompt is unknown."""
        if not replicas:
            raise ValueError("no routable replicas")
        by_url = {r.url: r for r in replicas}
        if self.policy == "round_robin":
            decision = choose_round_robin(list(by_url), next(self._rotation))
            return by_url[decision.key], decision
        snapshots = [r.snapshot(rate) for r, rate in zip(replicas, self.prefill_rates(replicas), strict=True)]
        if self.policy == "least_loaded" or profile is None:
            decision = choose_least_loaded([Candidate(s, 0) for s in snapshots], next(self._rotation))
            if self.policy != "least_loaded":  # cache-aware without a prompt: load only
                decision = decision._replace(reason=FALLBACK)
            return by_url[decision.key], decision
        candidates = [Candidate(s, by_url[s.key].cached_tokens(profile)) for s in snapshots]
        shape = RequestShape(
            prompt_tokens=profile.prompt_tokens,
            max_output_tokens=profile.max_output_tokens,
            tie_key=profile.tie_key(min(s.block_size for s in snapshots)),
        )
        decision = choose_cache_aware(shape, candidates, self.weights)
        return by_url[decision.key], decision
