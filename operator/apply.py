"""Create-or-patch of the operator's children, idempotently: no write when nothing differs.

Some fields are written only when the object is created (``CREATE_ONLY_FIELDS``): a Secret's ``data``
holds a generated value (the router token) that must stay what the pods already read, so a later
reconcile, whose builder drew a new value, leaves it alone. Such fields are kept out of the last-applied
annotation too (a secret value does not belong in metadata); a key missing from the live object (removed
by hand) is put back, an existing one is never changed.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api_names import LAST_APPLIED_ANNOTATION
from kvpilot.operator.diffing import merge_patch
from kvpilot.operator.kube_api import KubeApi, KubeApiError, ObjectRef

# kind -> top-level fields (mappings) whose keys are set on create and never overwritten afterwards.
CREATE_ONLY_FIELDS: dict[str, tuple[str, ...]] = {"Secret": ("data",)}


@dataclass(frozen=True)
class ApplyResult:
    ref: ObjectRef
    action: str  # "created", "patched" or "unchanged"
    patch: dict[str, Any] | None = None
    live: dict[str, Any] | None = None  # the object as the API server returned it after this apply


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


def _split_create_only(desired: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """(the fields reconciled on every pass, the create-only ones)."""
    fields = CREATE_ONLY_FIELDS.get(desired["kind"], ())
    managed = {key: value for key, value in desired.items() if key not in fields}
    return managed, {key: desired[key] for key in fields if key in desired}


def _missing_keys(create_only: dict[str, dict[str, Any]], live: dict[str, Any]) -> dict[str, Any]:
    """The create-only keys the live object lacks, as a merge patch (never a change to a present key)."""
    patch: dict[str, Any] = {}
    for field, wanted in create_only.items():
        have = live.get(field)
        have = have if isinstance(have, dict) else {}
        absent = {key: value for key, value in wanted.items() if key not in have}
        if absent:
            patch[field] = absent
    return patch


def apply_object(api: KubeApi, desired: dict[str, Any]) -> ApplyResult:
    ref = ObjectRef.of(desired)
    managed, create_only = _split_create_only(desired)
    annotated = with_last_applied(managed)
    live = api.get(ref)
    if live is None:
        try:
            created = api.create({**annotated, **copy.deepcopy(create_only)})
            return ApplyResult(ref, "created", live=created)
        except KubeApiError as error:
            # The status timer and a change handler can race to create the same child: patch instead.
            if error.status != 409:
                raise
            live = api.get(ref)
            if live is None:
                raise
    patch = {**merge_patch(annotated, live, _last_applied(live)), **_missing_keys(create_only, live)}
    if not patch:
        return ApplyResult(ref, "unchanged", live=live)
    return ApplyResult(ref, "patched", patch, live=api.merge_patch(ref, patch))


def apply_all(api: KubeApi, objects: tuple[dict[str, Any], ...]) -> list[ApplyResult]:
    return [apply_object(api, obj) for obj in objects]
