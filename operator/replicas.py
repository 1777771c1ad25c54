"""Where each replica stands on its way to serving, read from its pod and its engine's ``/ready``.

Kubernetes alone can say "scheduled", "container running" and "Ready"; only the engine knows whether it
is still loading weights or already warming up (its ``/ready`` body carries ``phase`` and ``progress``).
The operator asks the engines that are running but not Ready yet, with a short timeout; if an engine
cannot be reached, the pod's own signals decide (startup probe passed or not).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from kvpilot.operator import api_names

# Stages in the order a replica goes through them; "failing" is off the path.
STAGES = ("pending", "loading", "warmingUp", "ready")
FAILING = "failing"
# Container states that will not fix themselves without a change (image, config) or a code fix.
FAILING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
ENGINE_PHASE_STAGES = {"loading": "loading", "warming_up": "warmingUp", "ready": "warmingUp"}


@dataclass(frozen=True)
class EngineReport:
    phase: str
    progress: Any = None


@dataclass(frozen=True)
class ReplicaObservation:
    pod: str
    stage: str
    detail: str
    created_at: datetime | None
    ready_at: datetime | None
    cause: str = ""  # why a failing replica fails, when it is known: MODEL_FETCH_FAILED


MODEL_FETCH_FAILED = "ModelFetchFailed"


EngineReader = Callable[[str, int], "EngineReport | None"]


def read_engine_ready(host: str, port: int, timeout: float = 1.0) -> EngineReport | None:
    """GET http://host:port/ready; the body says the phase whatever the status code (503 while loading)."""
    url = f"http://{host}:{port}/ready"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        body = error.read()
    except (OSError, ValueError):
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("phase"), str):
        return None
    return EngineReport(phase=data["phase"], progress=data.get("progress"))


def parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value.replace("Z", "+00:00")) if value else None


def _condition(pod: dict[str, Any], kind: str) -> dict[str, Any]:
    for condition in pod.get("status", {}).get("conditions", []):
        if condition.get("type") == kind:
            return condition
    return {}


def _engine_status(pod: dict[str, Any]) -> dict[str, Any]:
    for status in pod.get("status", {}).get("containerStatuses", []):
        if status.get("name") == api_names.ENGINE_CONTAINER:
            return status
    return {}


def _engine_port(pod: dict[str, Any]) -> int:
    for container in pod.get("spec", {}).get("containers", []):
        if container.get("name") == api_names.ENGINE_CONTAINER:
            for port in container.get("ports", []):
                return int(port["containerPort"])
    return api_names.ENGINE_PORT


def ready_engine_address(pod: dict[str, Any]) -> tuple[str, int] | None:
    """(pod IP, engine port) of a Ready pod that is not on its way out, else None."""
    if pod.get("metadata", {}).get("deletionTimestamp") or _condition(pod, "Ready").get("status") != "True":
        return None
    ip = pod.get("status", {}).get("podIP")
    return (ip, _engine_port(pod)) if ip else None


def _progress_text(progress: Any) -> str:
    if isinstance(progress, int | float) and not isinstance(progress, bool):
        return f" ({progress:.0%})" if progress <= 1 else f" ({progress:g}%)"
    return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _init_stage(pod: dict[str, Any]) -> tuple[str, str, str] | None:
    """(stage, detail, cause) while the model-fetch init container has not succeeded yet, else None."""
    for status in pod.get("status", {}).get("initContainerStatuses", []):
        if status.get("name") != api_names.FETCH_CONTAINER:
            continue
        state = status.get("state", {})
        terminated = state.get("terminated") or {}
        if terminated.get("exitCode") == 0:
            return None
        if "running" in state:
            return "loading", "fetching the model", ""
        failed = terminated or status.get("lastState", {}).get("terminated") or {}
        if failed:
            message = _last_line(failed.get("message", "")) or f"exit code {failed.get('exitCode')}"
            return FAILING, message, MODEL_FETCH_FAILED
        waiting = state.get("waiting", {})
        return "pending", waiting.get("message") or waiting.get("reason") or "waiting to fetch the model", ""
    return None


def _stage(pod: dict[str, Any], read_engine: EngineReader) -> tuple[str, str, str]:
    """(stage, detail, cause)."""
    status = pod.get("status", {})
    if status.get("phase") in ("Failed", "Succeeded"):
        # e.g. Evicted: "Usage of EmptyDir volume "tmp" exceeds the limit" (model.cacheSize too small)
        why = ": ".join(part for part in (status.get("reason"), status.get("message")) if part)
        return FAILING, f"pod {status['phase'].lower()}" + (f" ({why})" if why else ""), ""
    scheduled = _condition(pod, "PodScheduled")
    if scheduled.get("status") == "False":
        return "pending", scheduled.get("message") or scheduled.get("reason") or "not scheduled", ""
    fetching = _init_stage(pod)
    if fetching is not None:
        return fetching
    return (*_container_stage(pod, status, read_engine), "")


def _container_stage(
    pod: dict[str, Any], status: dict[str, Any], read_engine: EngineReader
) -> tuple[str, str]:
    ready = _condition(pod, "Ready").get("status") == "True"
    engine = _engine_status(pod)
    state = engine.get("state", {})
    if "waiting" in state:
        reason = state["waiting"].get("reason", "")
        return (FAILING if reason in FAILING_REASONS else "pending"), reason or "waiting"
    if "terminated" in state:
        return FAILING, state["terminated"].get("reason") or "terminated"
    if "running" not in state:
        return "pending", "no engine container yet"
    if ready:
        return "ready", "ready"
    report = read_engine(status.get("podIP", ""), _engine_port(pod)) if status.get("podIP") else None
    if report is not None and report.phase in ENGINE_PHASE_STAGES:
        return ENGINE_PHASE_STAGES[report.phase], f"engine {report.phase}{_progress_text(report.progress)}"
    # No word from the engine: the startup probe (on /health) tells loading from the rest.
    return ("warmingUp", "started, not ready") if engine.get("started") else ("loading", "starting")


def observe_pod(
    pod: dict[str, Any], read_engine: EngineReader = read_engine_ready
) -> ReplicaObservation | None:
    """The replica's stage, or None for a pod on its way out (it no longer counts toward anything)."""
    metadata = pod.get("metadata", {})
    if metadata.get("deletionTimestamp"):
        return None
    stage, detail, cause = _stage(pod, read_engine)
    ready_condition = _condition(pod, "Ready")
    ready_at = parse_time(ready_condition.get("lastTransitionTime")) if stage == "ready" else None
    return ReplicaObservation(
        pod=metadata.get("name", ""),
        stage=stage,
        detail=detail,
        created_at=parse_time(metadata.get("creationTimestamp")),
        ready_at=ready_at,
        cause=cause,
    )
