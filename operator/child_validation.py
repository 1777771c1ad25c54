"""The API server's own rules for the children, checked before any is applied (docs/architecture.md#operator).

A spec the CRD accepts can still build a child that kube-apiserver refuses: an InferenceService name with
a dot, a leading digit or over 55 characters (the headless Service ``<name>-engines`` must be a DNS-1035
label of at most 63), a gpuType or nodeSelector value that is no label value, a toleration the core
validation refuses, an image with surrounding spaces. Checked here, such a spec is reported before any
child exists instead of leaving the children applied so far and a 422 on the next. The rules are the
subset of k8s.io/apimachinery/pkg/util/validation and pkg/apis/core/validation that the children's
fields can break; what is not checked here is still caught from the API server's answer (``apply``).
"""

from __future__ import annotations

import re
from typing import Any

_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS1123_LABEL = re.compile(rf"^{_LABEL}$")  # IsDNS1123Label, at most 63
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")  # IsDNS1035Label, at most 63
DNS1123_SUBDOMAIN = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")  # IsDNS1123Subdomain, at most 253
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")  # IsValidLabelValue, at most 63
QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")  # IsQualifiedName, at most 63

LABEL_RULE = "at most 63 characters, alphanumeric at both ends, '-', '_' or '.' between"
SUBDOMAIN_RULE = "a DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' or '.'"
DNS1035_RULE = (
    "a DNS-1035 label: at most 63 lowercase letters, digits or '-', starting with a letter and ending "
    "with a letter or digit"
)


def _show(value: Any, limit: int = 63) -> str:
    """A value as the message quotes it: one over ``limit`` characters cut; the length of a long one."""
    text = str(value)
    if len(text) > limit:
        return f"{text[:56]!r}... ({len(text)} characters)"
    return repr(text) + (f" ({len(text)} characters)" if len(text) > 63 else "")


def is_dns_subdomain(value: str) -> bool:
    """IsDNS1123Subdomain: a Kubernetes object name, or a DNS domain such as the cluster's."""
    return len(value) <= 253 and DNS1123_SUBDOMAIN.fullmatch(value) is not None


def _label_value(value: str) -> bool:
    return len(value) <= 63 and LABEL_VALUE.fullmatch(value) is not None


def _qualified_name(value: str) -> bool:
    prefix, _, name = value.rpartition("/")
    if "/" in value and not is_dns_subdomain(prefix):
        return False
    return len(name) <= 63 and QUALIFIED_NAME.fullmatch(name) is not None


def _labels(where: str, labels: dict[str, Any] | None, errors: list[str]) -> None:
    for key, value in (labels or {}).items():
        if not _qualified_name(key):
            errors.append(f"{where}: key {_show(key)} is not a qualified name")
        if not _label_value(str(value)):
            errors.append(f"{where}[{key}]: {_show(value)} is not a label value ({LABEL_RULE})")


def _tolerations(where: str, tolerations: list[dict[str, Any]], errors: list[str]) -> None:
    for index, toleration in enumerate(tolerations):
        at = f"{where}[{index}]"
        key, operator, value = (toleration.get(k) or "" for k in ("key", "operator", "value"))
        if key and not _qualified_name(key):
            errors.append(f"{at}.key: {_show(key)} is not a qualified name")
        if not key and operator != "Exists":
            errors.append(f"{at}.operator: must be 'Exists' when the key is empty")
        if operator == "Exists" and value:
            errors.append(f"{at}.value: must be empty when the operator is 'Exists'")
        if operator in ("", "Equal") and value and not _label_value(value):
            errors.append(f"{at}.value: {_show(value)} is not a label value ({LABEL_RULE})")
        if toleration.get("tolerationSeconds") is not None and toleration.get("effect") != "NoExecute":
            errors.append(f"{at}.effect: must be 'NoExecute' when tolerationSeconds is set")


def _pod(where: str, template: dict[str, Any], errors: list[str]) -> None:
    _labels(f"{where}.metadata.labels", template.get("metadata", {}).get("labels"), errors)
    spec = template.get("spec", {})
    for field in ("serviceAccountName", "priorityClassName"):
        if field in spec and not is_dns_subdomain(spec[field]):
            errors.append(f"{where}.spec.{field}: {_show(spec[field])} is not {SUBDOMAIN_RULE}")
    _labels(f"{where}.spec.nodeSelector", spec.get("nodeSelector"), errors)
    _tolerations(f"{where}.spec.tolerations", spec.get("tolerations") or [], errors)
    for secret in spec.get("imagePullSecrets") or []:
        if not is_dns_subdomain(secret.get("name", "")):
            errors.append(
                f"{where}.spec.imagePullSecrets: {_show(secret.get('name'))} is not {SUBDOMAIN_RULE}"
            )
    for volume in spec.get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is not None and not is_dns_subdomain(claim):
            errors.append(
                f"{where}.spec.volumes[{volume['name']}].claimName: {_show(claim)} is not {SUBDOMAIN_RULE}"
            )
    for container in (spec.get("initContainers") or []) + (spec.get("containers") or []):
        image = container.get("image", "")
        if image != image.strip():
            errors.append(
                f"{where}.spec.containers[{container['name']}].image: {_show(image)} has surrounding spaces"
            )


def child_errors(obj: dict[str, Any]) -> list[str]:
    """What kube-apiserver would refuse in ``obj``, one message a field, each naming the child."""
    kind, metadata, spec = obj["kind"], obj["metadata"], obj.get("spec") or {}
    errors: list[str] = []
    name = metadata["name"]
    if kind == "Service":
        if len(name) > 63 or DNS1035_LABEL.fullmatch(name) is None:
            errors.append(f"metadata.name: {_show(name, 80)} is not {DNS1035_RULE}")
        _labels("spec.selector", spec.get("selector"), errors)
    elif not is_dns_subdomain(name):
        errors.append(f"metadata.name: {_show(name, 80)} is not {SUBDOMAIN_RULE}")
    _labels("metadata.labels", metadata.get("labels"), errors)
    if "selector" in spec and kind != "Service":
        _labels("spec.selector.matchLabels", spec["selector"].get("matchLabels"), errors)
    if kind == "Deployment":
        _pod("spec.template", spec["template"], errors)
    return [f"{kind} {name[:63]}: {error}" for error in errors]


def children_errors(objects: tuple[dict[str, Any], ...]) -> list[str]:
    """Every child's, a problem once (a bad label is on every child: the first child names it)."""
    first: dict[str, str] = {}
    for obj in objects:
        for error in child_errors(obj):
            first.setdefault(error.split(": ", 1)[1], error)
    return list(first.values())
