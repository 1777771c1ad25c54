"""Every object the operator owns for one InferenceService (docs/architecture.md#operator).

``build_children`` is a pure function of the validated InferenceService: the same input always gives
the same objects, which is what makes reconciling idempotent and ``kvpilot operator render`` exact. The
one exception is the router token Secret's value, random unless given: it is written only when the Secret
is created (``apply.CREATE_ONLY_FIELDS``), so later reconciles never change it.
"""

from __future__ import annotations

import base64
import secrets
from dataclasses import dataclass
from typing import Any

from kvpilot.operator import api_names
from kvpilot.operator.activator_children import activator_deployment, activator_selector
from kvpilot.operator.pod_template import pod_template, router_token_secret_name
from kvpilot.operator.sizing import SizingResult, size_for_spec
from kvpilot.operator.spec import InferenceService
from kvpilot.operator.startup import startup_budget


@dataclass(frozen=True)
class Children:
    sizing: SizingResult
    objects: tuple[dict[str, Any], ...]  # in the order they are applied: access first, workload last


def selector_labels(isvc: InferenceService) -> dict[str, str]:
    return {api_names.SELECTOR_LABEL: isvc.name}


def common_labels(isvc: InferenceService) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "kvpilot",
        "app.kubernetes.io/instance": isvc.name,
        "app.kubernetes.io/component": "inference",
        "app.kubernetes.io/managed-by": api_names.MANAGED_BY,
        **selector_labels(isvc),
    }


def owner_reference(isvc: InferenceService) -> dict[str, Any]:
    return {
        "apiVersion": api_names.API_VERSION,
        "kind": api_names.KIND,
        "name": isvc.name,
        "uid": isvc.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(isvc: InferenceService, name: str) -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": name, "namespace": isvc.namespace, "labels": common_labels(isvc)}
    if isvc.uid:  # render without a cluster has no uid to point at
        metadata["ownerReferences"] = [owner_reference(isvc)]
    return metadata


def _router_access(isvc: InferenceService) -> list[dict[str, Any]]:
    name = f"{isvc.name}-router"
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _metadata(isvc, name)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": _metadata(isvc, name),
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["get", "list", "watch"],
                }
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": _metadata(isvc, name),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": isvc.namespace}],
        },
    ]


def new_router_token() -> str:
    return secrets.token_hex(api_names.ROUTER_TOKEN_BYTES)


def _router_token(isvc: InferenceService, token: str) -> dict[str, Any]:
    """The token the router sidecars present to the engines (``x-kvpilot-router-token``), one per
    InferenceService: every router may send to every engine of the service, so all pods share it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(isvc, router_token_secret_name(isvc)),
        "type": "Opaque",
        "data": {api_names.ROUTER_TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def _services(isvc: InferenceService, to_activator: bool) -> list[dict[str, Any]]:
    selector = selector_labels(isvc)
    engines = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc, f"{isvc.name}-engines"),
        # Headless: the router needs every engine's address (via EndpointSlices), not one virtual IP.
        # Not-ready engines are published too: the router probes each engine's /ready itself, and a
        # pod only turns Ready once its router is ready, which needs an engine it can see (chicken, egg).
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [
                {"name": "http", "port": api_names.ENGINE_PORT, "targetPort": "http", "protocol": "TCP"}
            ],
        },
    }
    client = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(isvc, isvc.name),
        # Scaled to zero (no Ready replica), clients reach the activator instead of the replicas' routers.
        "spec": {
            "type": "ClusterIP",
            "selector": activator_selector(isvc) if to_activator else selector,
            "ports": [
                {
                    "name": "http",
                    "port": api_names.SERVICE_PORT,
                    "targetPort": "http-router",
                    "protocol": "TCP",
                }
            ],
        },
    }
    return [engines, client]


def _disruption_budget(isvc: InferenceService, sizing: SizingResult) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(isvc, isvc.name),
        # At least 1: with no spare left (spare 0, or clamped away) a budget of 0 would block every node
        # drain forever; one at a time lets drains proceed, and condition SpareAvailable=False says so.
        "spec": {
            "maxUnavailable": max(1, sizing.disruption_allowance),
            "selector": {"matchLabels": selector_labels(isvc)},
        },
    }


def _deployment(isvc: InferenceService, sizing: SizingResult, default_image: str) -> dict[str, Any]:
    allowance = sizing.disruption_allowance
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(isvc, isvc.name),
        "spec": {
            "replicas": sizing.desired,
            "selector": {"matchLabels": selector_labels(isvc)},
            # Roll by taking down at most the spare pods, never more, so N stay serving; with no spare,
            # surge one new pod first instead (Kubernetes refuses maxSurge = maxUnavailable = 0).
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": allowance, "maxSurge": 0 if allowance else 1},
            },
            "progressDeadlineSeconds": startup_budget(isvc.spec.model).progress_deadline_seconds,
            "revisionHistoryLimit": 5,
            "template": pod_template(isvc, common_labels(isvc), selector_labels(isvc), default_image),
        },
    }


def build_children(
    isvc: InferenceService,
    default_image: str = api_names.DEFAULT_IMAGE,
    router_token: str | None = None,
    sizing: SizingResult | None = None,
    ready_replicas: int | None = None,
) -> Children:
    """``router_token``: the Secret's value if it has to be created (a fresh random one when None);
    ``sizing``: the autoscaler's result in autoscaling.mode operator (else the spec's own sizing);
    ``ready_replicas``: Ready engine pods now, for a service that scales to zero (None: unknown, as in
    ``render``: the client Service points at the replicas)."""
    sizing = sizing if sizing is not None else size_for_spec(isvc.spec)
    token = router_token if router_token is not None else new_router_token()
    # The Secret before the Deployment: a pod whose secretKeyRef names no Secret cannot start.
    objects = [
        *_router_access(isvc),
        _router_token(isvc, token),
        # To the activator while no replica is Ready, and already when going to zero: the Service must
        # never be left with no endpoint at all.
        *_services(isvc, isvc.spec.scales_to_zero and (ready_replicas == 0 or sizing.desired == 0)),
        _disruption_budget(isvc, sizing),
        _deployment(isvc, sizing, default_image),
    ]
    if isvc.spec.scales_to_zero:
        objects.append(
            activator_deployment(isvc, _metadata(isvc, isvc.name), common_labels(isvc), default_image)
        )
    return Children(sizing=sizing, objects=tuple(objects))
