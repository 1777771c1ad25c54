"""The objects of scale to zero (docs/architecture.md#scale-to-zero): the activator's Deployment and
where the client Service points.

The activator pods carry the InferenceService's common labels except its selector label, so neither the
engines' Service, the PodDisruptionBudget nor the replica count ever counts them; their own selector is
``kvpilot.dev/activator: <name>``. They run with the routers' ServiceAccount (EndpointSlices get/list/watch
is all they need) and the engine's image.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator import api_names
from kvpilot.operator.spec import InferenceService

ACTIVATOR_LABEL = f"{api_names.GROUP}/activator"
ACTIVATOR_CPU, ACTIVATOR_MEMORY = "50m", "128Mi"
QUEUE_SIZE = 256


def activator_name(isvc: InferenceService) -> str:
    return f"{isvc.name}-activator"


def activator_selector(isvc: InferenceService) -> dict[str, str]:
    return {ACTIVATOR_LABEL: isvc.name}


def activator_deployment(
    isvc: InferenceService, metadata: dict[str, Any], pod_labels: dict[str, str], default_image: str
) -> dict[str, Any]:
    """``metadata``: the child's name, namespace, labels and owner; ``pod_labels``: the common labels."""
    labels = {k: v for k, v in pod_labels.items() if k != api_names.SELECTOR_LABEL}
    labels.update(activator_selector(isvc), **{"app.kubernetes.io/component": "activator"})
    probe = {"httpGet": {"path": "/ready", "port": "http-router"}, "periodSeconds": 2, "failureThreshold": 3}
    container = {
        "name": "activator",
        "image": isvc.spec.engine.image or default_image,
        "command": ["kvpilot", "operator", "activator"],
        "args": [
            "--namespace",
            isvc.namespace,
            "--name",
            isvc.name,
            "--port",
            str(api_names.ROUTER_PORT),
            "--queue-size",
            str(QUEUE_SIZE),
            "--hold-timeout",
            str(isvc.spec.autoscaling.activator_hold_seconds),
        ],
        "ports": [{"name": "http-router", "containerPort": api_names.ROUTER_PORT, "protocol": "TCP"}],
        "resources": {
            "requests": {"cpu": ACTIVATOR_CPU, "memory": ACTIVATOR_MEMORY},
            "limits": {"memory": ACTIVATOR_MEMORY},
        },
        "readinessProbe": probe,
        "livenessProbe": {
            "httpGet": {"path": "/health", "port": "http-router"},
            "periodSeconds": 10,
            "failureThreshold": 3,
        },
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**metadata, "name": activator_name(isvc)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": activator_selector(isvc)},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "serviceAccountName": f"{isvc.name}-router",
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [container],
                },
            },
        },
    }
