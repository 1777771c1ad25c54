"""Building blocks of the InferenceService schema: the patterns and the typed-field helpers every block uses.

Structural OpenAPI v3 as a CRD wants it; ``obj`` also attaches the cross-field rules of its node
(``crd_rules``) as ``x-kubernetes-validations``.
"""

from __future__ import annotations

from typing import Any

from kvpilot.operator.crd_rules import rules_for

# Kubernetes' own resource.Quantity grammar, without a sign: memory and KV sizes are never negative.
QUANTITY_PATTERN = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"  # the number
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"  # its suffix, if any
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


def integer(description: str, minimum: int, maximum: int, default: int | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "integer",
        "format": "int32",
        "minimum": minimum,
        "maximum": maximum,
        "description": description,
    }
    if default is not None:
        schema["default"] = default
    return schema


def number(
    description: str,
    minimum: float,
    maximum: float,
    *,
    exclusive_minimum: bool = False,
    default: float | None = None,
) -> dict[str, Any]:
    schema: dict[str, Any] = {
        "type": "number",
        "minimum": minimum,
        "maximum": maximum,
        "description": description,
    }
    if exclusive_minimum:
        schema["exclusiveMinimum"] = True
    if default is not None:
        schema["default"] = default
    return schema


def quantity(description: str, default: str | None = None) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string", "pattern": QUANTITY_PATTERN, "maxLength": 32}
    if default is not None:
        schema["default"] = default
    return {**schema, "description": description}


def obj(
    description: str,
    properties: dict[str, Any],
    node: tuple[str, ...],
    *,
    required: tuple[str, ...] = (),
    default_empty: bool = True,
) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object", "description": description, "properties": properties}
    if required:
        schema["required"] = list(required)
    if default_empty:
        # An empty default makes the API server fill in the nested defaults when the block is omitted.
        schema["default"] = {}
    rules = rules_for(node)
    if rules:
        schema["x-kubernetes-validations"] = [
            {"rule": rule.cel, "message": rule.message, "fieldPath": f".{rule.field}"} for rule in rules
        ]
    return schema


def count(description: str) -> dict[str, Any]:
    return {"type": "integer", "format": "int32", "minimum": 0, "description": description}


def seconds(description: str) -> dict[str, Any]:
    return {"type": "number", "minimum": 0, "description": description}
