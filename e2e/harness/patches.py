"""Patch types and selectors of the Kubernetes API, as the harness emulates them.

- JSON merge patch (RFC 7386): what Kopf and the operator send;
- JSON patch (RFC 6902, with ``test``): what Kopf uses for finalizers, with optimistic concurrency;
- strategic merge patch, reduced: lists of named things (containers, env, ports, volumes, conditions)
  merge by their key and ``$patch: delete`` removes an item; the other directives are dropped. A real
  server reads merge keys and strategies from the Go types; this table covers what kubectl sends for the
  objects in these tests.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import jsonpatch

MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "ports": "containerPort",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "conditions": "type",
    "imagePullSecrets": "name",
    "tolerations": "key",
    "ownerReferences": "uid",
}


class PatchError(ValueError):
    pass


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: dict[str, Any], operations: Any) -> dict[str, Any]:
    if not isinstance(operations, list):
        raise PatchError("a JSON patch is a list of operations")
    try:
        return jsonpatch.apply_patch(copy.deepcopy(target), operations)
    except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as error:
        raise PatchError(str(error)) from error


def strategic_merge_patch(target: Any, patch: Any, key: str = "") -> Any:
    if isinstance(patch, list) and isinstance(target, list) and key in MERGE_KEYS:
        return _merge_list(target, patch, MERGE_KEYS[key])
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for name, value in patch.items():
        if name.startswith("$"):  # $setElementOrder/..., $retainKeys: ordering hints, not content
            continue
        if value is None:
            result.pop(name, None)
        else:
            result[name] = strategic_merge_patch(result.get(name), value, name)
    return result


def _merge_list(target: list[Any], patch: list[Any], merge_key: str) -> list[Any]:
    result = [copy.deepcopy(item) for item in target]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise PatchError(f"strategic merge patch item without its merge key {merge_key!r}")
        index = next((i for i, old in enumerate(result) if old.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                result.pop(index)
        elif index is None:
            result.append(strategic_merge_patch({}, item))
        else:
            result[index] = strategic_merge_patch(result[index], item)
    return result


_SET_EXPRESSION = re.compile(r"^\s*([\w./-]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(selector: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for char in selector:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    return [part.strip() for part in [*parts, current] if part.strip()]


def matches_label_selector(labels: dict[str, str], selector: str | None) -> bool:
    """Equality (=, ==, !=), set (in, notin) and existence (key, !key) requirements, all ANDed."""
    for requirement in _split_selector(selector or ""):
        set_match = _SET_EXPRESSION.match(requirement)
        if set_match:
            key, operator, values = set_match.groups()
            allowed = {value.strip() for value in values.split(",")}
            if (labels.get(key) in allowed) != (operator == "in"):
                return False
        elif "!=" in requirement:
            key, value = (s.strip() for s in requirement.split("!=", 1))
            if labels.get(key) == value:
                return False
        elif "=" in requirement:
            key, value = (s.strip() for s in requirement.replace("==", "=").split("=", 1))
            if labels.get(key) != value:
                return False
        elif requirement.startswith("!"):
            if requirement[1:].strip() in labels:
                return False
        elif requirement not in labels:
            return False
    return True


def matches_field_selector(obj: dict[str, Any], selector: str | None) -> bool:
    """Only metadata.name and metadata.namespace, with = and !=: what kubectl and Kopf send."""
    for requirement in _split_selector(selector or ""):
        negate = "!=" in requirement
        field, value = (s.strip() for s in requirement.replace("!=", "=").replace("==", "=").split("=", 1))
        if field not in ("metadata.name", "metadata.namespace"):
            raise PatchError(f"field selector {field!r} is not emulated")
        actual = obj.get("metadata", {}).get(field.split(".", 1)[1], "")
        if (actual == value) == negate:
            return False
    return True
