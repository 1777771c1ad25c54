"""Check an InferenceService spec the way the API server would, and name the offending field.

Order matters and mirrors the API server: defaults first (so rules see the values the engine will get),
then the OpenAPI schema (bounds, enums, types), then the cross-field rules that the CRD carries as CEL,
and last the checks a CRD cannot make: that the pod's memory holds a model of known size, and that such a
model splits over the replica's GPUs.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Iterable
from typing import Any

import jsonschema
from kubernetes.utils import parse_quantity

from kvpilot.operator.crd_rules import CPU_KV_CACHE_MEMORY, RULES
from kvpilot.operator.crd_schema import spec_schema
from kvpilot.operator.model_size import engine_dtype, memory_floor_bytes, tensor_parallel_problem


class SpecError(ValueError):
    """An invalid spec; ``field`` is the dotted path Kubernetes would name (``spec.scaling.spare``)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Fill in ``default`` values of absent properties, recursively, as structural defaulting does.

    Only objects that are present (or defaulted) get their properties defaulted, exactly like the API
    server: a block without ``default: {}`` that the user omitted stays omitted.
    """
    if isinstance(value, dict) and "properties" in schema:
        for key, sub_schema in schema["properties"].items():
            if key not in value and "default" in sub_schema:
                value[key] = copy.deepcopy(sub_schema["default"])
            if key in value:
                value[key] = apply_defaults(sub_schema, value[key])
    elif isinstance(value, list) and "items" in schema:
        return [apply_defaults(schema["items"], item) for item in value]
    return value


def _field_path(prefix: str, path: Iterable[Any]) -> str:
    field = prefix
    for part in path:
        field += f"[{part}]" if isinstance(part, int) else f".{part}"
    return field


def _schema_error(error: jsonschema.ValidationError) -> SpecError:
    path = list(error.absolute_path)
    if error.validator == "required":
        # jsonschema reports a missing property at its parent; Kubernetes names the property itself.
        missing = error.message.split("'")[1]
        return SpecError(_field_path("spec", [*path, missing]), "Required value")
    if error.validator == "additionalProperties" and error.validator_value is False:
        return SpecError(_field_path("spec", path), f"unknown field: {error.message}")
    message = f"Invalid value: {error.instance!r}: {error.message}"
    description = error.schema.get("description") if isinstance(error.schema, dict) else None
    if error.validator in ("maximum", "minimum") and description:
        # A bare bound does not say why it is there; the field's description does (e.g. resources.gpus).
        message += f" ({description.rstrip('.')})"
    return SpecError(_field_path("spec", path), message)


@functools.cache
def _python_regex(pattern: str) -> re.Pattern[str]:
    """The OpenAPI ``pattern`` as the API server matches it (Go's RE2, where ``$`` is only the end of the
    text) in Python, whose ``$`` also matches before a final newline: each ``$`` anchor becomes ``\\Z``.
    ASCII: RE2's ``\\s``, ``\\d`` and ``\\w`` are ASCII classes, Python's match any Unicode space, digit or
    letter (a no-break space in a path passed the API server and failed here)."""
    out, escaped, in_class = [], False, False
    for char in pattern:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == "[":
            in_class = True
        elif char == "]":
            in_class = False
        elif char == "$" and not in_class:
            char = r"\Z"
        out.append(char)
    return re.compile("".join(out), re.ASCII)


def _re2_pattern(validator: Any, pattern: str, instance: Any, schema: dict[str, Any]) -> Iterable[Any]:
    if validator.is_type(instance, "string") and not _python_regex(pattern).search(instance):
        yield jsonschema.ValidationError(f"{instance!r} does not match {pattern!r}")


# "1Gi\n" passed Python's pattern, then failed parse_quantity with a ValueError instead of a SpecError.
_Validator = jsonschema.validators.extend(jsonschema.Draft4Validator, {"pattern": _re2_pattern})


def _node(spec: dict[str, Any], node: tuple[str, ...]) -> dict[str, Any] | None:
    value: Any = {"spec": spec}
    for key in node:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return value


def validated_spec(raw_spec: Any) -> dict[str, Any]:
    """Return the defaulted spec, or raise SpecError for the first problem (deterministic order)."""
    if not isinstance(raw_spec, dict):
        raise SpecError("spec", "Required value: an object")
    schema = spec_schema()
    spec = apply_defaults(schema, copy.deepcopy(raw_spec))
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(spec), key=lambda e: (list(map(str, e.absolute_path)), e.message))
    if errors:
        raise _schema_error(errors[0])
    for rule in RULES:
        node = _node(spec, rule.node)
        if node is not None and not rule.holds(node):
            raise SpecError(rule.field_path, rule.message)
    _check_memory_fits_model(spec)
    _check_gpus_split_model(spec)
    return spec


def _check_gpus_split_model(spec: dict[str, Any]) -> None:
    """resources.gpus is the engine's tensor-parallel size: a model of known shape must split that many
    ways, or every pod would fail its start (docs/architecture.md#tensor-parallelism)."""
    problem = tensor_parallel_problem(spec["model"]["source"], spec["resources"]["gpus"])
    if problem is not None:
        raise SpecError(
            "spec.resources.gpus", f"{problem}: the replica's GPUs split the model (tensor parallelism)"
        )


def _mib(quantity: int) -> str:
    return f"{-(-quantity // 2**20)}Mi"


def _check_memory_fits_model(spec: dict[str, Any]) -> None:
    """A pod whose memory cannot hold the model would be OOM-killed at every load: refuse it up front.

    Only models of known size are checked, so this rule has no CEL twin (the CRD cannot know sizes): on a
    real cluster it surfaces as the InvalidSpec condition.
    """
    model, resources = spec["model"], spec["resources"]
    on_gpu = resources["gpus"] > 0
    kv = int(parse_quantity(spec["engine"].get("kvCacheMemory", CPU_KV_CACHE_MEMORY)))
    floor = memory_floor_bytes(model["source"], model["dtype"], on_gpu, kv)
    if floor is None or parse_quantity(resources["memory"]) >= floor:
        return
    dtype = engine_dtype(model["dtype"], on_gpu)
    held = (
        "its weights are converted to float32 in the pod's memory, shard by shard, before they stream to "
        "the GPU"
        if on_gpu
        else f"its {dtype} weights and the KV cache live in the pod's memory"
    )
    raise SpecError(
        "spec.resources.memory",
        f"{model['source']} needs at least {_mib(floor)} ({held}, beside the engine's runtime), "
        f"got {resources['memory']}",
    )
