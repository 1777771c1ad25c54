"""kube-apiserver's validation of built-in objects, the part the operator's children can break: names,
labels, selectors, the pod template's nodeSelector, tolerations and images.

A real API server answers 422 to a Service named ``llama.v2`` or a nodeSelector value ``NVIDIA A100``; a
harness that stored them would let a test pass that a cluster fails. The rules are those of
k8s.io/apimachinery/pkg/util/validation (IsDNS1123Label, IsDNS1035Label, IsDNS1123Subdomain,
IsQualifiedName, IsValidLabelValue) and pkg/apis/core/validation (ValidateTolerations), written here
apart from the operator's own checks so that each tests the other.
"""

from __future__ import annotations

import re
from typing import Any

DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
# RBAC objects only need a valid path segment (ValidateRBACName); everything else not listed: a subdomain.
PATH_SEGMENT_KINDS = frozenset({"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"})

Causes = list[tuple[str, str]]


def _label(value: str) -> bool:
    return len(value) <= 63 and DNS1123_LABEL.fullmatch(value) is not None


def _subdomain(value: str) -> bool:
    return len(value) <= 253 and DNS1123_SUBDOMAIN.fullmatch(value) is not None


def _qualified(key: str) -> bool:
    prefix, slash, name = key.rpartition("/")
    if slash and not _subdomain(prefix):
        return False
    return len(name) <= 63 and QUALIFIED_NAME.fullmatch(name) is not None


def _name_ok(kind: str, name: str) -> tuple[bool, str]:
    if kind == "Service":
        return len(name) <= 63 and DNS1035_LABEL.fullmatch(name) is not None, "a DNS-1035 label"
    if kind == "Namespace":
        return _label(name), "a DNS-1123 label"
    if kind in PATH_SEGMENT_KINDS:
        return name not in (".", "..") and not set(name) & {"/", "%"}, "a path segment name"
    return _subdomain(name), "a DNS-1123 subdomain"


def _labels(field: str, labels: Any, causes: Causes) -> None:
    for key, value in (labels or {}).items():
        if not _qualified(str(key)):
            causes.append(
                (field, f"Invalid value: {key!r}: name part must consist of alphanumeric characters")
            )
        if not isinstance(value, str) or len(value) > 63 or LABEL_VALUE.fullmatch(value) is None:
            causes.append(
                (f"{field}", f"Invalid value: {value!r}: a valid label must be 63 characters or less")
            )


def _tolerations(field: str, tolerations: Any, causes: Causes) -> None:
    for index, toleration in enumerate(tolerations or []):
        at = f"{field}[{index}]"
        key, operator, value = (toleration.get(k) or "" for k in ("key", "operator", "value"))
        if key and not _qualified(key):
            causes.append((f"{at}.key", f"Invalid value: {key!r}"))
        if not key and operator != "Exists":
            causes.append((f"{at}.operator", "operator must be Exists when `key` is empty"))
        if operator == "Exists" and value:
            causes.append((f"{at}.operator", "value must be empty when `operator` is 'Exists'"))
        if operator in ("", "Equal") and value and (len(value) > 63 or LABEL_VALUE.fullmatch(value) is None):
            causes.append((f"{at}.value", f"Invalid value: {value!r}"))
        if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
            causes.append((f"{at}.effect", "effect must be 'NoExecute' when `tolerationSeconds` is set"))


def _pod_template(field: str, template: dict[str, Any], causes: Causes) -> None:
    _labels(f"{field}.metadata.labels", template.get("metadata", {}).get("labels"), causes)
    spec = template.get("spec") or {}
    _labels(f"{field}.spec.nodeSelector", spec.get("nodeSelector"), causes)
    _tolerations(f"{field}.spec.tolerations", spec.get("tolerations"), causes)
    for group in ("initContainers", "containers"):
        for index, container in enumerate(spec.get(group) or []):
            image = container.get("image", "")
            if image != image.strip():
                causes.append(
                    (f"{field}.spec.{group}[{index}].image", "must not have leading or trailing whitespace")
                )


def causes(kind: str, obj: dict[str, Any], custom: bool) -> Causes:
    """(field, message) for each rule ``obj`` breaks; a custom resource gets the metadata rules only."""
    found: Causes = []
    metadata = obj.get("metadata") or {}
    name = metadata.get("name") or ""
    ok, rule = (_subdomain(name), "a DNS-1123 subdomain") if custom else _name_ok(kind, name)
    if not ok:
        found.append(("metadata.name", f"Invalid value: {name!r}: must be {rule}"))
    _labels("metadata.labels", metadata.get("labels"), found)
    if custom:
        return found
    spec = obj.get("spec") or {}
    if kind == "Service":
        _labels("spec.selector", spec.get("selector"), found)
    elif isinstance(spec.get("selector"), dict):
        _labels("spec.selector.matchLabels", spec["selector"].get("matchLabels"), found)
    if kind in ("Deployment", "ReplicaSet", "StatefulSet", "DaemonSet", "Job") and "template" in spec:
        _pod_template("spec.template", spec["template"], found)
    if kind == "Pod":
        _pod_template("", {"metadata": metadata, "spec": spec}, found)
    return found
