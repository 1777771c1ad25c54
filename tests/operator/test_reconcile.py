"""A spec the operator refuses surfaces as a status condition, and nothing reaches the cluster."""

from __future__ import annotations

from typing import Any

from kvpilot.operator.config import OperatorConfig
from kvpilot.operator.reconcile import reconcile


class NoApi:
    """Any call fails the test: an invalid spec must not create, patch or even read children."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"reconcile called KubeApi.{name} for an invalid spec")


def test_more_than_one_gpu_from_an_older_crd_is_reported_and_builds_no_deployment():
    # An object stored under an older CRD (gpus up to 16) reaches the operator although today's CRD refuses it.
    body = {"apiVersion": "kvpilot.dev/v1alpha1", "kind": "InferenceService",
            "metadata": {"name": "llama", "namespace": "ml", "uid": "u-1", "generation": 4},
            "spec": {"model": {"source": "pvc://models/llama"}, "resources": {"gpus": 2, "memory": "64Gi"}}}
    result = reconcile(NoApi(), body, OperatorConfig(default_image="img:1"))
    assert (result.applied, result.error.field) == ((), "spec.resources.gpus")
    status = result.status_patch
    assert (status["phase"], status["observedGeneration"]) == ("Failed", 4)
    message = ("spec.resources.gpus: Invalid value: 2: 2 is greater than the maximum of 1 (GPUs per replica "
               "(nvidia.com/gpu): 0 or 1; more would need tensor parallelism, which is not supported yet)")
    assert [(c["type"], c["status"], c["reason"], c["message"]) for c in status["conditions"]] == [
        ("Ready", "False", "InvalidSpec", message), ("Progressing", "False", "Idle", message),
        ("Degraded", "True", "InvalidSpec", message)]
