"""Decide whether a live object still says what the operator wants, and the patch that makes it so.

The comparison is "desired is contained in live": the API server adds defaults and other controllers add
fields, and neither is drift. Every field the operator sets, though, is owned: a manual edit of one shows
up as a difference and gets patched back. A field the operator set last time but no longer wants is
removed via the last-applied annotation, the same three-way idea as ``kubectl apply``. Lists are patched
whole (JSON merge patch replaces lists): when one differs from live element by element, or from the list
last applied (a key dropped inside an element, e.g. a container's GPU limit, is contained in live and
would otherwise never roll out).
"""

from __future__ import annotations

from typing import Any

from kubernetes.utils import parse_quantity

# Where string values are resource quantities, which the API server stores canonically ("1000m" as "1",
# "1.5Gi" as "1536Mi"): every value under these keys, and these keys' own values.
QUANTITY_PARENTS = frozenset({"requests", "limits"})
QUANTITY_KEYS = frozenset({"sizeLimit"})
_MISSING = object()


def _same_quantity(want: str, have: str) -> bool:
    try:
        return parse_quantity(want) == parse_quantity(have)
    except ValueError:
        return False


def _context(key: str, value: Any, parent_key: str) -> str:
    """A nested object is judged in its own key's context, a scalar in its parent's ("requests"), unless
    the scalar's own key names a quantity ("sizeLimit")."""
    return key if isinstance(value, dict | list) or key in QUANTITY_KEYS else parent_key


def contains(want: Any, have: Any, parent_key: str = "") -> bool:
    """True when every field in ``want`` is present in ``have`` with the same value."""
    if isinstance(want, dict):
        return isinstance(have, dict) and all(
            key in have and contains(value, have[key], _context(key, value, parent_key))
            for key, value in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(contains(w, h, parent_key) for w, h in zip(want, have, strict=True))
        )
    quantity = parent_key in QUANTITY_PARENTS or parent_key in QUANTITY_KEYS
    if quantity and isinstance(want, str) and isinstance(have, str):
        return want == have or _same_quantity(want, have)
    return bool(want == have and type(want) is type(have))


def merge_patch(
    desired: dict[str, Any], live: dict[str, Any], last_applied: dict[str, Any], parent_key: str = ""
) -> dict[str, Any]:
    """The JSON merge patch that makes ``live`` contain ``desired``; empty when it already does."""
    patch: dict[str, Any] = {}
    for key, want in desired.items():
        have = live.get(key, _MISSING)
        if isinstance(want, dict) and isinstance(have, dict):
            previous = last_applied.get(key)
            sub_patch = merge_patch(want, have, previous if isinstance(previous, dict) else {}, key)
            if sub_patch:
                patch[key] = sub_patch
        elif not contains(want, have, _context(key, want, parent_key)) or (
            isinstance(want, list) and key in last_applied and last_applied[key] != want
        ):
            patch[key] = want
    for key in last_applied:
        if key not in desired and key in live:
            patch[key] = None  # the operator set it before and does not want it any more
    return patch
