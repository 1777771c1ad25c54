"""N+1 replica sizing (docs/architecture.md#replica-sizing).

desired = clamp(ceil(target × (1 + headroom) / perReplicaGoodput) + spare, min, max), or with a fixed
count, clamp(replicas + spare, min, max). Arithmetic is exact (fractions of the decimal inputs), so a
target that is an exact multiple of the goodput never rounds up to one replica too many.

In ``autoscaling.mode: external`` the count is ``spec.replicas`` as the scale subresource set it, unclamped
(the HPA or KEDA object has its own bounds; clamping here would fight it); the static sizing stands in
until something sets it. Mode ``operator`` gets its result from ``autoscaler`` instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from kvpilot.operator.spec import InferenceServiceSpec, ScalingSpec


def _exact(value: float) -> Fraction:
    # str() gives the shortest decimal that round-trips, i.e. the number the user wrote in YAML.
    return Fraction(str(value))


def _number_text(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class SizingResult:
    mode: str  # "Replicas", "Rate", "External" or "Autoscaler"
    scaling: ScalingSpec
    serving: int  # replicas needed to carry the load (N)
    unclamped: int  # N + spare
    desired: int  # after the min/max clamp
    spec_replicas: int | None = None  # mode External: spec.replicas (None: not set yet)
    formula_text: str | None = None  # a formula of its own (External, Autoscaler)
    #: further status.sizing fields (the autoscaler's inputs and decision), in status order
    extra: tuple[tuple[str, Any], ...] = ()

    @property
    def capacity_limited(self) -> bool:
        """N alone exceeds maxReplicas: the clamp leaves the load short of capacity (not just of spare).

        Never while external mode follows spec.replicas: that count is not clamped (module docstring)."""
        return self.spec_replicas is None and self.serving > self.scaling.max_replicas

    @property
    def disruption_allowance(self) -> int:
        """Pods that may be down at once without dropping below N: the spare ones that survived the clamp."""
        return max(0, min(self.scaling.spare, self.desired - self.serving))

    @property
    def formula(self) -> str:
        s = self.scaling
        if self.formula_text is not None:
            return self.formula_text
        if self.mode == "Rate":
            needed = (
                f"ceil({_number_text(s.target_requests_per_second or 0)} × (1 + {_number_text(s.headroom)})"
                f" / {_number_text(s.per_replica_goodput or 0)})"
            )
        else:
            needed = str(s.replicas)
        return f"clamp({needed} + {s.spare}, {s.min_replicas}, {s.max_replicas}) = {self.desired}"

    def to_status(self) -> dict[str, Any]:
        s = self.scaling
        status: dict[str, Any] = {"mode": self.mode}
        if self.mode == "External":
            if self.spec_replicas is not None:
                status["specReplicas"] = self.spec_replicas
        elif self.mode == "Autoscaler":
            status["perReplicaGoodput"] = s.per_replica_goodput
            status["headroom"] = s.headroom
        elif self.mode == "Rate":
            status["targetRequestsPerSecond"] = s.target_requests_per_second
            status["perReplicaGoodput"] = s.per_replica_goodput
            status["headroom"] = s.headroom
        else:
            status["replicas"] = s.replicas
        status.update(
            {
                "spare": s.spare,
                "minReplicas": s.min_replicas,
                "maxReplicas": s.max_replicas,
                "serving": self.serving,
                "unclamped": self.unclamped,
                "desiredReplicas": self.desired,
                "capacityLimited": self.capacity_limited,
                "formula": self.formula,
            }
        )
        status.update(self.extra)
        return status


def serving_replicas(scaling: ScalingSpec) -> tuple[str, int]:
    """The mode and N, the replicas that carry the target load within the SLO (before spare)."""
    if scaling.target_requests_per_second is not None and scaling.per_replica_goodput is not None:
        load = _exact(scaling.target_requests_per_second) * (1 + _exact(scaling.headroom))
        return "Rate", math.ceil(load / _exact(scaling.per_replica_goodput))
    # Neither form given means one replica: the smallest useful service.
    return "Replicas", scaling.replicas if scaling.replicas is not None else 1


def size_replicas(scaling: ScalingSpec) -> SizingResult:
    mode, serving = serving_replicas(scaling)
    unclamped = serving + scaling.spare
    desired = min(max(unclamped, scaling.min_replicas), scaling.max_replicas)
    return SizingResult(mode=mode, scaling=scaling, serving=serving, unclamped=unclamped, desired=desired)


def size_for_spec(spec: InferenceServiceSpec) -> SizingResult:
    """The count of the modes that need no measurement: off (the scaling block) and external."""
    static = size_replicas(spec.scaling)
    if spec.autoscaling.mode != "external":
        return static
    if spec.replicas is None:
        return replace(static, mode="External", formula_text=f"spec.replicas unset: {static.formula}")
    replicas, spare = spec.replicas, spec.scaling.spare
    return SizingResult(
        mode="External",
        scaling=spec.scaling,
        # The count includes the spare (it is the pods' count): N is what is left when the spare is off.
        serving=max(0, replicas - spare),
        unclamped=replicas,
        desired=replicas,
        spec_replicas=replicas,
        formula_text=f"spec.replicas = {replicas} (autoscaling.mode external)",
    )
