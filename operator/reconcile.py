"""One reconciliation of one InferenceService: validate, apply the children, observe, compute status.

Kopf-free on purpose: the handlers' queue calls ``reconcile`` and writes the returned status patch, so
this logic is unit-testable with a fake API and the same whatever triggered it (a change, a watched
child's event, a follow-up, the resync).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from kvpilot.operator import api_names, metrics
from kvpilot.operator.activator_children import activator_selector
from kvpilot.operator.apply import ApplyResult, ChildError, apply_all
from kvpilot.operator.autoscaler import Autoscaler
from kvpilot.operator.child_validation import children_errors
from kvpilot.operator.children import build_children
from kvpilot.operator.config import DEFAULT_CLUSTER_DOMAIN, OperatorConfig
from kvpilot.operator.diffing import merge_patch
from kvpilot.operator.events import post_event
from kvpilot.operator.kube_api import KubeApi, ObjectRef
from kvpilot.operator.replicas import (
    EngineReader,
    ReplicaObservation,
    observe_pod,
    read_engine_ready,
    ready_engine_address,
)
from kvpilot.operator.sizing import SizingResult
from kvpilot.operator.spec import InferenceService, SpecError
from kvpilot.operator.status import (
    CapacityView,
    Observed,
    capacity_conditions,
    cold_start_status,
    conditions,
    decide_phase,
    stage_counts,
)

log = logging.getLogger(__name__)


#: replica stages that only the engine's /ready body tells apart: no watch event marks their progress
ENGINE_REPORTED_STAGES = frozenset({"loading", "warmingUp"})


@dataclass(frozen=True)
class Reconciled:
    status_patch: dict[str, Any]  # empty when the status already says it all
    applied: tuple[ApplyResult, ...] = ()
    error: SpecError | None = None
    #: an engine is loading or warming up: look again after the status interval (handlers.py)
    follow_up: bool = False
    #: autoscaling.mode operator: seconds until the autoscaler's next evaluation is due
    autoscale_in: float | None = None
    #: ChildConflict or ChildRejected: a child could not be applied; try again later, backing off
    blocked: str | None = None


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _rollout(deployment: dict[str, Any] | None, desired: int) -> tuple[bool, bool]:
    """(stalled, complete) from the Deployment's own status."""
    if deployment is None:
        return False, False
    status = deployment.get("status", {})
    stalled = any(
        c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
        for c in status.get("conditions", [])
    )
    observed = status.get("observedGeneration", 0) >= deployment.get("metadata", {}).get("generation", 0)
    updated = status.get("updatedReplicas", 0)
    complete = observed and updated >= desired and status.get("replicas", 0) == updated
    return stalled, complete


def _observe(
    api: KubeApi, isvc: InferenceService, read_engine: EngineReader, deployment: dict[str, Any] | None
) -> tuple[tuple[ReplicaObservation, ...], dict[str, Any] | None]:
    """The replicas, and the Deployment as just applied (its status is the controller's; no second GET)."""
    pods = api.list(ObjectRef("v1", "Pod", isvc.namespace), f"{api_names.SELECTOR_LABEL}={isvc.name}")
    observations = (
        observe_pod(pod, read_engine) for pod in sorted(pods, key=lambda p: p["metadata"]["name"])
    )
    return tuple(o for o in observations if o is not None), deployment


def _status(
    isvc: InferenceService,
    sizing: SizingResult,
    replicas: tuple[ReplicaObservation, ...],
    deployment: dict[str, Any] | None,
    previous: dict[str, Any],
    cluster_domain: str = DEFAULT_CLUSTER_DOMAIN,
) -> dict[str, Any]:
    stalled, complete = _rollout(deployment, sizing.desired)
    was_ready = (
        previous.get("phase") in ("Ready", "Degraded")
        and previous.get("observedGeneration") == isvc.generation
    )
    observed = Observed(
        desired=sizing.desired,
        replicas=replicas,
        rollout_stalled=stalled,
        rollout_complete=complete,
        was_ready=was_ready,
    )
    phase, reason, message = decide_phase(observed)
    counts = stage_counts(observed)
    before, now = previous.get("conditions", []), _now()
    capacity = CapacityView(
        serving=sizing.serving,
        desired=sizing.desired,
        max_replicas=isvc.spec.scaling.max_replicas,
        spare=isvc.spec.scaling.spare,
        allowance=sizing.disruption_allowance,
        limited=sizing.capacity_limited,
        external=sizing.spec_replicas is not None,
    )
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": conditions(phase, reason, message, isvc.generation, before, now)
        + capacity_conditions(capacity, isvc.generation, before, now),
        "replicas": len(replicas),
        "readyReplicas": counts["ready"],
        "desiredReplicas": sizing.desired,
        "observedGeneration": isvc.generation,
        "endpoint": f"http://{isvc.name}.{isvc.namespace}.svc.{cluster_domain}",
        # The scale subresource's labelSelectorPath: an HPA finds the engine pods' metrics through it.
        "selector": f"{api_names.SELECTOR_LABEL}={isvc.name}",
        "sizing": sizing.to_status(),
        "engines": counts,
    }
    cold_start = cold_start_status(replicas, previous.get("coldStart", {}))
    if cold_start:
        status["coldStart"] = cold_start
    return status


def _failed_status(reason: str, message: str, generation: int, previous: dict[str, Any]) -> dict[str, Any]:
    return {
        "phase": "Failed",
        "conditions": conditions(
            "Failed", reason, message, generation, previous.get("conditions", []), _now()
        ),
        "observedGeneration": generation,
    }


#: the most problems one condition message lists (a 64-character name breaks a label on every child)
MESSAGE_PROBLEMS = 3


def _children_refused(
    api: KubeApi, isvc: InferenceService, reason: str, problems: list[str], previous: dict[str, Any]
) -> dict[str, Any]:
    """Failed with ``reason`` and the problems, as a status patch; an Event when the condition is new."""
    more = len(problems) - MESSAGE_PROBLEMS
    message = "; ".join(problems[:MESSAGE_PROBLEMS]) + (f"; and {more} more" if more > 0 else "")
    ready: dict[str, Any] = next((c for c in previous.get("conditions", []) if c.get("type") == "Ready"), {})
    if (ready.get("reason"), ready.get("message")) != (reason, message):
        log.warning("%s/%s: %s: %s", isvc.namespace, isvc.name, reason, message)
        post_event(api, isvc, "Warning", reason, message)
    metrics.RECONCILIATIONS.labels("invalid" if reason == "InvalidSpec" else "error").inc()
    status = _failed_status(reason, message, isvc.generation, previous)
    return merge_patch(status, previous, previous)


def _record_cold_starts(previous: dict[str, Any], status: dict[str, Any]) -> None:
    seen = {entry["pod"] for entry in previous.get("coldStart", {}).get("recent", [])}
    for entry in status.get("coldStart", {}).get("recent", []):
        if entry["pod"] not in seen:
            metrics.COLD_START.observe(entry["seconds"])


def _autoscale(
    api: KubeApi, isvc: InferenceService, autoscaler: Autoscaler | None, previous: dict[str, Any]
) -> tuple[SizingResult | None, float | None, int | None]:
    """In autoscaling.mode operator, the autoscaler's count, when its next evaluation is due and the Ready
    replicas now (else None: the spec's own sizing)."""
    if autoscaler is None:
        return None, None, None
    if isvc.spec.autoscaling.mode != "operator":
        autoscaler.forget((isvc.namespace, isvc.name))  # back in this mode later: windows start afresh
        return None, None, None
    pods = api.list(ObjectRef("v1", "Pod", isvc.namespace), f"{api_names.SELECTOR_LABEL}={isvc.name}")
    engines = {
        pod["metadata"]["name"]: address for pod in pods if (address := ready_engine_address(pod)) is not None
    }
    activator = None
    if isvc.spec.scales_to_zero:
        selector = ",".join(f"{k}={v}" for k, v in activator_selector(isvc).items())
        for pod in api.list(ObjectRef("v1", "Pod", isvc.namespace), selector):
            if (address := ready_engine_address(pod)) is not None:
                activator = (address[0], api_names.ROUTER_PORT)
    evaluation = autoscaler.evaluate(isvc, engines, previous, activator)
    for event in evaluation.events:
        log.info("%s/%s: %s: %s", isvc.namespace, isvc.name, event.reason, event.message)
        post_event(api, isvc, event.type, event.reason, event.message)
    return evaluation.sizing, evaluation.next_in, len(engines)


def reconcile(
    api: KubeApi, body: dict[str, Any], config: OperatorConfig, autoscaler: Autoscaler | None = None
) -> Reconciled:
    previous = body.get("status") or {}
    generation = int(body.get("metadata", {}).get("generation", 0))
    try:
        isvc = InferenceService.from_manifest(body)
    except SpecError as error:
        metrics.RECONCILIATIONS.labels("invalid").inc()
        status = _failed_status("InvalidSpec", str(error), generation, previous)
        return Reconciled(merge_patch(status, previous, previous), error=error)
    autoscaled, autoscale_in, ready_now = _autoscale(api, isvc, autoscaler, previous)
    children = build_children(isvc, config.default_image, sizing=autoscaled, ready_replicas=ready_now)
    # What the API server would refuse is reported before any child is written (child_validation).
    problems = children_errors(children.objects)
    if problems:
        return Reconciled(_children_refused(api, isvc, "InvalidSpec", problems, previous))
    try:
        applied = tuple(apply_all(api, children.objects))
    except ChildError as error:
        status_patch = _children_refused(api, isvc, error.reason, [str(error)], previous)
        return Reconciled(status_patch, blocked=error.reason)
    changed = [result for result in applied if result.action != "unchanged"]
    for result in changed:
        log.info("%s %s", result.action, result.ref)
    metrics.RECONCILIATIONS.labels("applied" if changed else "unchanged").inc()
    read_engine = functools.partial(read_engine_ready, timeout=config.engine_probe_timeout_seconds)
    deployment = next(
        (r.live for r in applied if r.ref.kind == "Deployment" and r.ref.name == isvc.name), None
    )
    replicas, deployment = _observe(api, isvc, read_engine, deployment)
    status = _status(isvc, children.sizing, replicas, deployment, previous, config.cluster_domain)
    _record_cold_starts(previous, status)
    metrics.record_status(
        isvc.namespace,
        isvc.name,
        desired=children.sizing.desired,
        spare=max(0, children.sizing.desired - children.sizing.serving),
        serving=children.sizing.serving,
        ready=status["readyReplicas"],
        phase=status["phase"],
    )
    # Fields of the old status that the new one lacks are removed, the rest only if they changed.
    follow_up = any(replica.stage in ENGINE_REPORTED_STAGES for replica in replicas)
    return Reconciled(
        merge_patch(status, previous, previous), applied, follow_up=follow_up, autoscale_in=autoscale_in
    )
