"""The InferenceService status: phase, conditions and counts, from the replicas' observed stages.

Rules, in order (the first that applies wins):
- the spec is invalid → Failed;
- nothing is desired (minReplicas 0, no load, no spare) → Idle (Ready False, reason ScaledToZero), never
  "Ready 0/0": no replica serves;
- ready ≥ desired → Ready (the only way to Ready: every desired replica serves, warm);
- nothing ready and a replica is failing or the rollout exceeded its deadline → Failed (reason
  ModelFetchFailed when every failing replica could not fetch its model, the fetcher's message given);
- some ready but a replica is failing, or the service was Ready for this generation and lost replicas
  → Degraded;
- otherwise the rollout is on its way, and the slowest replica names the phase: Pending, Loading or
  WarmingUp (the service becomes Ready only when the last replica does).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.operator.replicas import FAILING, MODEL_FETCH_FAILED, STAGES, ReplicaObservation

STAGE_PHASES = {"pending": "Pending", "loading": "Loading", "warmingUp": "WarmingUp"}
COLD_START_KEEP = 5


@dataclass(frozen=True)
class Observed:
    desired: int
    replicas: tuple[ReplicaObservation, ...]
    rollout_stalled: bool = False
    rollout_complete: bool = True  # the Deployment runs only the current template, as many as desired
    was_ready: bool = False  # the previous status said Ready/Degraded for this same generation


def stage_counts(observed: Observed) -> dict[str, int]:
    counts = Counter(replica.stage for replica in observed.replicas)
    missing = max(0, observed.desired - len(observed.replicas))  # not even a pod yet: pending
    return {
        "pending": counts["pending"] + missing,
        "loading": counts["loading"],
        "warmingUp": counts["warmingUp"],
        "ready": counts["ready"],
        "failing": counts[FAILING],
    }


def _failing_detail(observed: Observed) -> str:
    failing = [r for r in observed.replicas if r.stage == FAILING]
    return "; ".join(f"{r.pod}: {r.detail}" for r in failing[:3])


def _failing_reason(observed: Observed) -> str:
    """ModelFetchFailed when every failing replica failed to fetch its model, else ReplicasFailing."""
    causes = {r.cause for r in observed.replicas if r.stage == FAILING}
    return MODEL_FETCH_FAILED if causes == {MODEL_FETCH_FAILED} else "ReplicasFailing"


def decide_phase(observed: Observed) -> tuple[str, str, str]:
    """(phase, reason, message) for a valid spec."""
    counts = stage_counts(observed)
    ready, desired = counts["ready"], observed.desired
    summary = f"{ready}/{desired} replicas ready"
    if desired == 0:
        left = len(observed.replicas)
        return (
            "Idle",
            "ScaledToZero",
            "scaled to zero: no replica serves" + (f" ({left} still stopping)" if left else ""),
        )
    if ready >= desired and observed.rollout_complete:
        return "Ready", "ReplicasReady", summary
    if ready == 0 and (counts["failing"] or observed.rollout_stalled):
        detail = _failing_detail(observed) or "rollout exceeded its progress deadline"
        reason = _failing_reason(observed) if counts["failing"] else "ReplicasFailing"
        return "Failed", reason, f"{summary}; {detail}"
    if counts["failing"]:
        return "Degraded", _failing_reason(observed), f"{summary}; {_failing_detail(observed)}"
    if observed.was_ready:
        return "Degraded", "ReplicasLost", summary
    slowest = next((stage for stage in STAGES[:-1] if counts[stage] > 0), "pending")
    waiting = ", ".join(f"{counts[s]} {s}" for s in ("pending", "loading", "warmingUp") if counts[s])
    return STAGE_PHASES[slowest], "RolloutInProgress", f"{summary}; {waiting or 'rollout starting'}"


def _condition(
    kind: str,
    true: bool,
    reason: str,
    message: str,
    generation: int,
    previous: list[dict[str, Any]],
    now: str,
) -> dict[str, Any]:
    status = "True" if true else "False"
    before = next((c for c in previous if c.get("type") == kind), {})
    # The transition time moves only when the status flips, as Kubernetes conditions do.
    since = before.get("lastTransitionTime") if before.get("status") == status else None
    return {
        "type": kind,
        "status": status,
        "reason": reason,
        "message": message,
        "lastTransitionTime": since or now,
        "observedGeneration": generation,
    }


@dataclass(frozen=True)
class CapacityView:
    """What the sizing says about capacity, for the CapacityLimited and SpareAvailable conditions."""

    serving: int  # N
    desired: int
    max_replicas: int
    spare: int  # scaling.spare
    allowance: int  # spare replicas left after the clamp (the PodDisruptionBudget's, before its floor of 1)
    limited: bool  # N itself exceeds maxReplicas (sizing.SizingResult.capacity_limited)
    #: autoscaling.mode external follows spec.replicas: no maxReplicas clamp applies
    external: bool = False


def capacity_conditions(
    view: CapacityView, generation: int, previous: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    """CapacityLimited: N itself exceeds maxReplicas. SpareAvailable: a replica may go (drain, failure,
    rollout) without dropping below N; with none, the PodDisruptionBudget still allows one at a time, so a
    node drain takes a serving replica down instead of blocking forever (docs/architecture.md#status)."""
    limited = view.limited
    if view.external:
        limited_reason = "ExternalReplicas"
        limited_message = (
            f"autoscaling.mode external: spec.replicas {view.desired} runs as set (the external "
            "autoscaler's bounds apply, not scaling.maxReplicas)"
        )
    elif limited:
        limited_reason = "MaxReplicasReached"
        limited_message = (
            f"{view.serving} replicas needed to carry the load, scaling.maxReplicas is {view.max_replicas}"
        )
    else:
        limited_reason = "WithinMaxReplicas"
        limited_message = f"{view.serving} replicas needed, within scaling.maxReplicas {view.max_replicas}"
    if view.allowance > 0:
        spare = (True, "SpareReplicas", f"{view.allowance} spare above the {view.serving} serving")
    elif view.desired == 0:
        spare = (False, "ScaledToZero", "no replica runs")
    elif view.spare == 0:
        spare = (
            False,
            "NoSpare",
            "scaling.spare is 0: a drain, a failure or a rollout takes a serving replica down (the "
            "PodDisruptionBudget allows one at a time so that drains can proceed)",
        )
    else:
        spare = (
            False,
            "SpareClamped",
            f"scaling.maxReplicas {view.max_replicas} leaves no spare above the {view.serving} serving",
        )
    return [
        _condition(
            "CapacityLimited",
            limited,
            limited_reason,
            limited_message,
            generation,
            previous,
            now,
        ),
        _condition("SpareAvailable", spare[0], spare[1], spare[2], generation, previous, now),
    ]


def conditions(
    phase: str, reason: str, message: str, generation: int, previous: list[dict[str, Any]], now: str
) -> list[dict[str, Any]]:
    progressing = phase in STAGE_PHASES.values()
    return [
        _condition("Ready", phase == "Ready", reason, message, generation, previous, now),
        _condition(
            "Progressing", progressing, reason if progressing else "Idle", message, generation, previous, now
        ),
        _condition("Degraded", phase in ("Degraded", "Failed"), reason, message, generation, previous, now),
    ]


def cold_start_status(replicas: tuple[ReplicaObservation, ...], previous: dict[str, Any]) -> dict[str, Any]:
    """Creation-to-Ready seconds of the most recent replicas, merged with what earlier status saw."""
    recent = {entry["pod"]: entry for entry in previous.get("recent", [])}
    new_samples = 0
    for replica in replicas:
        if replica.ready_at is None or replica.created_at is None or replica.pod in recent:
            continue
        seconds = max(0.0, (replica.ready_at - replica.created_at).total_seconds())
        recent[replica.pod] = {"pod": replica.pod, "seconds": seconds, "readyAt": _iso(replica.ready_at)}
        new_samples += 1
    kept = sorted(recent.values(), key=lambda entry: (entry["readyAt"], entry["pod"]), reverse=True)
    kept = kept[:COLD_START_KEEP]
    if not kept:
        return {}
    return {
        "samples": int(previous.get("samples", 0)) + new_samples,
        "lastSeconds": kept[0]["seconds"],
        "maxSeconds": max([entry["seconds"] for entry in kept] + [previous.get("maxSeconds", 0.0)]),
        "recent": kept,
    }


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
