"""Create-or-patch of the operator's children, idempotently: no write when nothing differs."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api_names import LAST_APPLIED_ANNOTATION
from kvpilot.operator.diffing import merge_patch
from kvpilot.operator.kube_api import KubeApi, KubeApiError, ObjectRef


@dataclass(frozen=True)
class ApplyResult:
    ref: ObjectRef
    action: str  # "created", "patched" or "unchanged"
    patch: dict[str, Any] | None = None


def with_last_applied(desired: dict[str, Any]) -> dict[str, Any]:
    """The desired object carrying its own compact JSON, to know later which fields the operator set."""
    annotated = copy.deepcopy(desired)
    text = json.dumps(desired, sort_keys=True, separators=(",", ":"))
    annotated["metadata"].setdefault("annotations", {})[LAST_APPLIED_ANNOTATION] = text
    return annotated


def _last_applied(live: dict[str, Any]) -> dict[str, Any]:
    text = live.get("metadata", {}).get("annotations", {}).get(LAST_APPLIED_ANNOTATION)
    try:
        previous = json.loads(text) if text else {}
    except ValueError:  # someone edited the annotation by hand: fall back to a two-way comparison
        previous = {}
    return previous if isinstance(previous, dict) else {}


def apply_object(api: KubeApi, desired: dict[str, Any]) -> ApplyResult:
    ref = ObjectRef.of(desired)
    annotated = with_last_applied(desired)
    live = api.get(ref)
    if live is None:
        try:
            api.create(annotated)
            return ApplyResult(ref, "created")
        except KubeApiError as error:
            # The status timer and a change handler can race to create the same child: patch instead.
            if error.status != 409:
                raise
            live = api.get(ref)
            if live is None:
                raise
    patch = merge_patch(annotated, live, _last_applied(live))
    if not patch:
        return ApplyResult(ref, "unchanged")
    api.merge_patch(ref, patch)
    return ApplyResult(ref, "patched", patch)


def apply_all(api: KubeApi, objects: tuple[dict[str, Any], ...]) -> list[ApplyResult]:
    return [apply_object(api, obj) for obj in objects]
