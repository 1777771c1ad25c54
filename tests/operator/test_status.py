"""Phase rules, conditions and cold-start bookkeeping, from replica observations."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from kvpilot.operator.replicas import EngineReport, ReplicaObservation, observe_pod
from kvpilot.operator.status import (
    CapacityView,
    Observed,
    capacity_conditions,
    cold_start_status,
    conditions,
    decide_phase,
)

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def replicas(*stages: str) -> tuple[ReplicaObservation, ...]:
    return tuple(
        ReplicaObservation(
            f"p{i}",
            stage,
            "CrashLoopBackOff" if stage == "failing" else stage,
            T0,
            T0 + timedelta(seconds=30 + i) if stage == "ready" else None,
        )
        for i, stage in enumerate(stages)
    )


@pytest.mark.parametrize(
    ("observed", "phase", "reason"),
    [
        (Observed(3, replicas("ready", "ready", "ready")), "Ready", "ReplicasReady"),
        (
            Observed(3, replicas("ready", "ready", "ready"), rollout_complete=False),
            "Pending",
            "RolloutInProgress",
        ),
        (Observed(3, replicas("ready", "warmingUp", "loading")), "Loading", "RolloutInProgress"),
        (Observed(3, replicas("warmingUp", "warmingUp", "ready")), "WarmingUp", "RolloutInProgress"),
        (Observed(3, replicas("ready", "loading")), "Pending", "RolloutInProgress"),  # a pod not even created
        (Observed(2, replicas("failing", "loading")), "Failed", "ReplicasFailing"),
        (Observed(2, replicas("loading", "loading"), rollout_stalled=True), "Failed", "ReplicasFailing"),
        (Observed(2, replicas("ready", "failing")), "Degraded", "ReplicasFailing"),
        (Observed(2, replicas("ready", "loading"), was_ready=True), "Degraded", "ReplicasLost"),
    ],
)
def test_phase_rules(observed, phase, reason):
    assert decide_phase(observed)[:2] == (phase, reason)


def test_messages_count_stages():
    assert (
        decide_phase(Observed(3, replicas("ready", "warmingUp", "loading")))[2]
        == "1/3 replicas ready; 1 loading, 1 warmingUp"
    )
    assert (
        decide_phase(Observed(2, replicas("ready", "failing")))[2]
        == "1/2 replicas ready; p1: CrashLoopBackOff"
    )


def test_conditions_keep_transition_times_until_status_flips():
    first = conditions("Loading", "RolloutInProgress", "m", 1, [], "t1")
    assert [(c["type"], c["status"]) for c in first] == [
        ("Ready", "False"),
        ("Progressing", "True"),
        ("Degraded", "False"),
    ]
    later = conditions("Ready", "ReplicasReady", "m", 1, first, "t2")
    assert [c["lastTransitionTime"] for c in later] == ["t2", "t2", "t1"]


def test_cold_starts_accumulate_and_keep_the_latest_five():
    status = cold_start_status(replicas("ready", "ready", "loading"), {})
    assert (status["samples"], status["lastSeconds"], status["maxSeconds"]) == (2, 31.0, 31.0)
    again = cold_start_status(replicas("ready", "ready"), status)
    assert again == status  # the same pods are not counted twice


def pod(state: dict, ready: bool = False, started: bool = False) -> dict:
    return {
        "metadata": {"name": "p", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"containers": [{"name": "engine", "ports": [{"containerPort": 8000}]}]},
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True" if ready else "False",
                    "lastTransitionTime": "2026-01-01T00:01:00Z",
                }
            ],
            "containerStatuses": [{"name": "engine", "state": state, "started": started}],
        },
    }


def test_pod_stages_use_the_engine_report_when_there_is_one():
    asked = []

    def reader(host, port):
        asked.append((host, port))
        return EngineReport("warming_up", 0.5)

    assert observe_pod(pod({"running": {}}), reader).stage == "warmingUp"
    assert observe_pod(pod({"running": {}}), reader).detail == "engine warming_up (50%)"
    assert asked[0] == ("10.0.0.1", 8000)
    assert observe_pod(pod({"running": {}}), lambda h, p: None).stage == "loading"
    assert observe_pod(pod({"running": {}}, started=True), lambda h, p: None).stage == "warmingUp"
    ready = observe_pod(pod({"running": {}}, ready=True), reader)
    assert (ready.stage, (ready.ready_at - ready.created_at).total_seconds()) == ("ready", 60.0)
    assert observe_pod(pod({"waiting": {"reason": "ImagePullBackOff"}}), reader).stage == "failing"
    assert observe_pod(pod({"waiting": {"reason": "ContainerCreating"}}), reader).stage == "pending"
    leaving = pod({"running": {}})
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:02:00Z"
    assert observe_pod(leaving, reader) is None


def _fetching_pod(init_status: dict) -> dict:
    return {
        "metadata": {"name": "smol-1", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "False"},
            ],
            "initContainerStatuses": [{"name": "fetch-model", **init_status}],
            "containerStatuses": [{"name": "engine", "state": {"waiting": {"reason": "PodInitializing"}}}],
        },
    }


def test_a_replica_fetching_its_model_is_loading_and_a_failed_fetch_names_why():
    fetching = observe_pod(_fetching_pod({"state": {"running": {}}}))
    assert (fetching.stage, fetching.detail, fetching.cause) == ("loading", "fetching the model", "")
    message = "downloading\nmodel fetch failed: sha256 mismatch for http://m/x.gguf: expected 00, got ff"
    failed = observe_pod(
        _fetching_pod(
            {
                "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": message}},
            }
        )
    )
    assert (failed.stage, failed.cause) == ("failing", "ModelFetchFailed")
    assert failed.detail == "model fetch failed: sha256 mismatch for http://m/x.gguf: expected 00, got ff"
    phase, reason, text = decide_phase(Observed(1, (failed,)))
    assert (phase, reason) == ("Failed", "ModelFetchFailed") and failed.detail in text
    # a fetch failure beside another kind of failure is not only a fetch problem
    crashing = replicas("failing")[0]
    assert decide_phase(Observed(2, (failed, crashing)))[1] == "ReplicasFailing"
    done = _fetching_pod({"state": {"terminated": {"exitCode": 0, "reason": "Completed"}}})
    assert observe_pod(done).stage == "pending"  # the engine container is starting: the pod's own signals


def test_an_evicted_pod_says_why():
    pod = {
        "metadata": {"name": "smol-1"},
        "status": {
            "phase": "Failed",
            "reason": "Evicted",
            "message": 'Usage of EmptyDir volume "tmp" exceeds the limit "10Gi".',
        },
    }
    observed = observe_pod(pod)
    assert observed.stage == "failing"
    assert observed.detail == 'pod failed (Evicted: Usage of EmptyDir volume "tmp" exceeds the limit "10Gi".)'


def test_zero_desired_is_idle_not_ready_zero_of_zero():
    assert decide_phase(Observed(0, ())) == ("Idle", "ScaledToZero", "scaled to zero: no replica serves")
    assert decide_phase(Observed(0, replicas("ready"))) == (
        "Idle",
        "ScaledToZero",
        "scaled to zero: no replica serves (1 still stopping)",
    )
    ready = conditions("Idle", "ScaledToZero", "m", 1, [], "t")[0]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "ScaledToZero")


def _capacity(**view) -> list[tuple[str, str, str, str]]:
    found = capacity_conditions(CapacityView(**view), 3, [], "t")
    return [(c["type"], c["status"], c["reason"], c["message"]) for c in found]


def test_capacity_limited_is_against_n_and_spare_available_says_why_not():
    assert _capacity(serving=6, desired=4, max_replicas=4, spare=1, allowance=0, limited=True) == [
        (
            "CapacityLimited",
            "True",
            "MaxReplicasReached",
            "6 replicas needed to carry the load, scaling.maxReplicas is 4",
        ),
        (
            "SpareAvailable",
            "False",
            "SpareClamped",
            "scaling.maxReplicas 4 leaves no spare above the 6 serving",
        ),
    ]
    assert _capacity(serving=2, desired=3, max_replicas=4, spare=1, allowance=1, limited=False) == [
        ("CapacityLimited", "False", "WithinMaxReplicas", "2 replicas needed, within scaling.maxReplicas 4"),
        ("SpareAvailable", "True", "SpareReplicas", "1 spare above the 2 serving"),
    ]
    no_spare = _capacity(serving=2, desired=2, max_replicas=4, spare=0, allowance=0, limited=False)[1]
    assert no_spare[:3] == ("SpareAvailable", "False", "NoSpare")
    assert "the PodDisruptionBudget allows one at a time" in no_spare[3]
    assert _capacity(serving=0, desired=0, max_replicas=4, spare=0, allowance=0, limited=False)[1][:3] == (
        "SpareAvailable",
        "False",
        "ScaledToZero",
    )
