"""The ``scale`` subresource of a custom resource, as the API server serves it from the CRD's paths.

``GET .../<name>/scale`` answers an ``autoscaling/v1`` Scale built from ``specReplicasPath``,
``statusReplicasPath`` and ``labelSelectorPath``; a PUT or a merge/JSON patch of that Scale writes its
``spec.replicas`` back at ``specReplicasPath`` (a spec change: the generation moves), which is what
``kubectl scale``, the HorizontalPodAutoscaler controller and KEDA do.
"""

from __future__ import annotations

import copy
from typing import Any


def _path(path: str) -> list[str]:
    return [part for part in path.strip(".").split(".") if part]


def _read(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in _path(path):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def scale_of(paths: dict[str, Any], obj: dict[str, Any]) -> dict[str, Any]:
    """The Scale object of ``obj`` (its metadata: name, namespace, uid, resourceVersion, timestamp)."""
    metadata = obj["metadata"]
    status: dict[str, Any] = {"replicas": _read(obj, paths["statusReplicasPath"]) or 0}
    selector = _read(obj, paths["labelSelectorPath"]) if "labelSelectorPath" in paths else None
    if selector:
        status["selector"] = selector
    return {
        "apiVersion": "autoscaling/v1",
        "kind": "Scale",
        "metadata": {
            key: metadata[key]
            for key in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
            if key in metadata
        },
        "spec": {"replicas": _read(obj, paths["specReplicasPath"]) or 0},
        "status": status,
    }


def with_replicas(paths: dict[str, Any], obj: dict[str, Any], scale: dict[str, Any]) -> dict[str, Any]:
    """``obj`` with the Scale's spec.replicas written at ``specReplicasPath``."""
    replicas = scale.get("spec", {}).get("replicas")
    if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
        raise ValueError(f"spec.replicas: Invalid value: {replicas!r}: must be a non-negative integer")
    new = copy.deepcopy(obj)
    *parents, last = _path(paths["specReplicasPath"])
    node = new
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = replicas
    return new
