"""What the API server does with a CustomResourceDefinition once it is created, emulated.

It serves the new resource (discovery, kinds, short names, status subresource), defaults, prunes and
validates objects against the version's ``openAPIV3Schema`` with ``jsonschema``, renders
``kubectl get`` tables from ``additionalPrinterColumns``, and publishes an OpenAPI v3 document per group
version so kubectl hands field validation to the server. CEL rules (``x-kubernetes-validations``) are
NOT evaluated: jsonschema has no CEL; on a real cluster they reject the object at admission.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import jsonschema


@dataclass
class CustomResource:
    group: str
    version: str
    plural: str
    kind: str
    namespaced: bool
    schema: dict[str, Any]
    printer_columns: list[dict[str, Any]]
    subresources: dict[str, Any]


class InvalidObject(ValueError):
    def __init__(self, causes: list[tuple[str, str]]) -> None:
        super().__init__("; ".join(f"{field}: {message}" for field, message in causes))
        self.causes = causes


def from_crd(crd: dict[str, Any]) -> list[CustomResource]:
    spec = crd["spec"]
    names = spec["names"]
    return [
        CustomResource(
            group=spec["group"],
            version=version["name"],
            plural=names["plural"],
            kind=names["kind"],
            namespaced=spec.get("scope", "Namespaced") == "Namespaced",
            schema=version.get("schema", {}).get("openAPIV3Schema", {"type": "object"}),
            printer_columns=version.get("additionalPrinterColumns", []),
            subresources=version.get("subresources", {}),
        )
        for version in spec["versions"]
        if version.get("served", True)
    ]


def _default(schema: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in schema:
        for key, sub in schema["properties"].items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                value[key] = _default(sub, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [_default(schema["items"], item) for item in value]
    return value


def _prune(schema: dict[str, Any], value: Any, path: str, unknown: list[str]) -> Any:
    """Drop fields the structural schema does not declare; remember them for fieldValidation=Strict."""
    if (
        isinstance(value, dict)
        and schema.get("type") == "object"
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    ):
        properties = schema.get("properties")
        additional = schema.get("additionalProperties")
        if properties is None and isinstance(additional, dict):
            return {key: _prune(additional, item, f"{path}.{key}", unknown) for key, item in value.items()}
        if properties is None:
            return value
        kept = {}
        for key, item in value.items():
            if key in properties:
                kept[key] = _prune(properties[key], item, f"{path}.{key}", unknown)
            else:
                unknown.append(f"{path}.{key}")
        return kept
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune(schema["items"], item, f"{path}[{i}]", unknown) for i, item in enumerate(value)]
    return value


def admit(resource: CustomResource, obj: dict[str, Any], strict: bool) -> dict[str, Any]:
    """Default, prune and validate; metadata is the API server's own business and is left alone."""
    metadata = obj.get("metadata", {})
    body = {key: value for key, value in obj.items() if key != "metadata"}
    unknown: list[str] = []
    body = _prune(resource.schema, _default(resource.schema, body), "", unknown)
    if strict and unknown:
        raise InvalidObject([(field.lstrip("."), "field not declared in schema") for field in unknown])
    validator = jsonschema.Draft4Validator(
        {
            **resource.schema,
            "properties": {
                key: value
                for key, value in resource.schema.get("properties", {}).items()
                if key != "metadata"
            },
        }
    )
    causes = []
    for error in sorted(validator.iter_errors(body), key=lambda e: list(map(str, e.absolute_path))):
        field = ".".join(str(part) for part in error.absolute_path)
        if error.validator == "required":
            field = ".".join(filter(None, [field, error.message.split("'")[1]]))
            causes.append((field, "Required value"))
        else:
            causes.append((field, f"Invalid value: {error.instance!r}: {error.message}"))
    if causes:
        raise InvalidObject(causes)
    return {"metadata": metadata, **body}


def _json_path(obj: Any, path: str) -> Any:
    for part in path.strip(".").split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def age(timestamp: str | None, now: datetime | None = None) -> str:
    if not timestamp:
        return "<unknown>"
    moment = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = int(((now or datetime.now(timezone.utc)) - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= 2 * size:
            return f"{seconds // size}{unit}"
    return f"{max(seconds, 0)}s"


def table(
    objects: list[dict[str, Any]], columns: list[dict[str, Any]], resource_version: str
) -> dict[str, Any]:
    """A meta.k8s.io/v1 Table, the server-side printing that `kubectl get` asks for."""
    definitions = [{"name": "Name", "type": "string", "format": "name", "description": "", "priority": 0}]
    definitions += [
        {
            "name": c["name"],
            "type": c["type"],
            "format": c.get("format", ""),
            "description": c.get("description", ""),
            "priority": c.get("priority", 0),
        }
        for c in columns
    ] or [{"name": "Age", "type": "date", "format": "", "description": "", "priority": 0}]
    paths = [c["jsonPath"] for c in columns] or [".metadata.creationTimestamp"]
    rows = []
    for obj in objects:
        cells: list[Any] = [obj["metadata"]["name"]]
        for definition, path in zip(definitions[1:], paths, strict=True):
            value = _json_path(obj, path)
            cells.append(
                age(value) if definition["type"] == "date" else ("<none>" if value is None else value)
            )
        rows.append(
            {
                "cells": cells,
                "object": {
                    "kind": "PartialObjectMetadata",
                    "apiVersion": "meta.k8s.io/v1",
                    "metadata": obj["metadata"],
                },
            }
        )
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": definitions,
        "rows": rows,
    }


def openapi_document(
    group: str, version: str, kinds: list[tuple[str, str, bool]], schemas: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """An OpenAPI v3 document with one PATCH operation per kind that accepts ``fieldValidation``.

    kubectl reads exactly that to decide that the server validates fields itself, so it sends
    ``fieldValidation=Strict`` instead of validating against schemas on the client.
    """
    prefix = f"/apis/{group}/{version}" if group else f"/api/{version}"
    paths: dict[str, Any] = {}
    for kind, plural, namespaced in kinds:
        gvk = {"group": group, "version": version, "kind": kind}
        path = (
            f"{prefix}/namespaces/{{namespace}}/{plural}/{{name}}"
            if namespaced
            else f"{prefix}/{plural}/{{name}}"
        )
        content = {
            "application/merge-patch+json": {"schema": {"type": "object"}},
            "application/json-patch+json": {"schema": {"type": "object"}},
        }
        paths[path] = {
            "patch": {
                "x-kubernetes-action": "patch",
                "x-kubernetes-group-version-kind": gvk,
                "parameters": [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}}],
                "requestBody": {"content": content},
                "responses": {"200": {"description": "OK"}},
            }
        }
    components = {
        name: {
            **schema,
            "x-kubernetes-group-version-kind": [
                {"group": group, "version": version, "kind": name.rsplit(".", 1)[-1]}
            ],
        }
        for name, schema in schemas.items()
    }
    return {
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (kvpilot e2e harness)", "version": "v1.37.0"},
        "paths": paths,
        "components": {"schemas": components},
    }
