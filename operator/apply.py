"""Create-or-patch of the operator's children, idempotently: no write when nothing differs.

Some fields are written only when the object is created (``CREATE_ONLY_FIELDS``): a Secret's ``data``
holds a generated value (the router token) that must stay what the pods already read, so a later
reconcile, whose builder drew a new value, leaves it alone. Such fields are kept out of the last-applied
annotation too (a secret value does not belong in metadata); a key missing from the live object (removed
by hand) is put back, an existing one is never changed.

An object is written only when it is the operator's: created by it, controlled (ownerReferences) by the
same InferenceService (or a previous one of its name, which no longer exists: names are unique), or, with
no controller, labelled as managed by the operator for that InferenceService (children orphaned by an
uninstall, docs/architecture.md#operator). Anything else - another InferenceService's child of the same
name, a user's own object - is a ``ChildError`` (``ChildConflict``) and is left as it is; so is an
object the API server refuses (400/422, ``ChildRejected``).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from typing import Any

from kvpilot.operator.api_names import LAST_APPLIED_ANNOTATION, MANAGED_BY, SELECTOR_LABEL
from kvpilot.operator.diffing import merge_patch
from kvpilot.operator.kube_api import KubeApi, KubeApiError, ObjectRef

# kind -> top-level fields (mappings) whose keys are set on create and never overwritten afterwards.
CREATE_ONLY_FIELDS: dict[str, tuple[str, ...]] = {"Secret": ("data",)}
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
#: the API server's answers that say the object itself is wrong (retrying the same object cannot help)
REJECTED_STATUSES = frozenset({400, 422})


class ChildError(Exception):
    """A child that cannot be applied: ``reason`` ChildConflict or ChildRejected, for the status."""

    def __init__(self, reason: str, ref: ObjectRef, message: str) -> None:
        super().__init__(f"{ref.kind} {ref.name}: {message}")
        self.reason, self.ref = reason, ref


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


def _controller(metadata: dict[str, Any]) -> dict[str, Any] | None:
    return next((ref for ref in metadata.get("ownerReferences") or [] if ref.get("controller")), None)


def foreign_owner(desired: dict[str, Any], live: dict[str, Any]) -> str | None:
    """Who owns ``live`` when it is not the desired object's owner (None: the operator may write it)."""
    want, have = desired["metadata"], live.get("metadata", {})
    owner, holder = _controller(want), _controller(have)
    if holder is not None:
        if owner is not None and (holder.get("kind"), holder.get("name")) == (owner["kind"], owner["name"]):
            return None  # this InferenceService, or the deleted one whose name it took over
        return f"controlled by {holder.get('kind')} {holder.get('name')}"
    labels, wanted = have.get("labels") or {}, want.get("labels") or {}
    if labels.get(MANAGED_BY_LABEL) == MANAGED_BY and labels.get(SELECTOR_LABEL) == wanted.get(
        SELECTOR_LABEL
    ):
        return None
    return "not created by the operator for this InferenceService (no owner reference, other labels)"


def _rejected(ref: ObjectRef, error: KubeApiError) -> ChildError:
    return ChildError("ChildRejected", ref, f"refused by the API server: {error}")


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
            if error.status in REJECTED_STATUSES:
                raise _rejected(ref, error) from error
            # The status timer and a change handler can race to create the same child: patch instead.
            if error.status != 409:
                raise
            live = api.get(ref)
            if live is None:
                raise
    owner = foreign_owner(desired, live)
    if owner is not None:
        raise ChildError("ChildConflict", ref, f"an object of this name exists, {owner}; left as it is")
    patch = {**merge_patch(annotated, live, _last_applied(live)), **_missing_keys(create_only, live)}
    if not patch:
        return ApplyResult(ref, "unchanged", live=live)
    try:
        return ApplyResult(ref, "patched", patch, live=api.merge_patch(ref, patch))
    except KubeApiError as error:
        if error.status in REJECTED_STATUSES:
            raise _rejected(ref, error) from error
        raise


def apply_all(api: KubeApi, objects: tuple[dict[str, Any], ...]) -> list[ApplyResult]:
    return [apply_object(api, obj) for obj in objects]
