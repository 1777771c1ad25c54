"""A request's structured-output fields → one ``StructuredOutputsParams``, compiled before the request is
queued (docs/architecture.md#structured-outputs). Any failure is a 400; an unsupported JSON-schema keyword
is named in ``param``.

Accepted, at most one of them per request:
- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` (the schema is
  enforced whether ``strict`` is true or not; without ``schema``, any JSON object);
- vLLM's ``structured_outputs``: ``{"json" | "regex" | "choice" | "grammar" | "json_object",
  "disable_any_whitespace"}``;
- vLLM's older ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from kvpilot.engine.server.errors import bad_request
from kvpilot.engine.server.protocol import SamplingFields
from kvpilot.engine.server.structured_metrics import StructuredMetrics
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.structured.grammar import GrammarError
from kvpilot.engine.structured.params import KINDS, StructuredOutputsError, StructuredOutputsParams

GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}
#: ``structured_outputs`` keys that are vLLM backend switches: nothing to choose here
_BACKEND_KEYS = frozenset({"disable_fallback", "disable_additional_properties"})
_SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def requested_structure(body: SamplingFields) -> tuple[StructuredOutputsParams, str] | None:
    """The request's constraint and the field it came from (the ``param`` of its compile errors, unless
    they name a JSON-schema keyword); None when it asks for free text."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if body.response_format is not None:
        spec = _response_format(body.response_format)
        if spec is not None:
            where = "response_format.json_schema.schema" if spec.kind == "json" else "response_format"
            found.append((spec, where))
    if body.structured_outputs is not None:
        spec = _structured_outputs(body.structured_outputs)
        found.append((spec, f"structured_outputs.{spec.kind}"))
    for field, kind in GUIDED.items():
        value = getattr(body, field)
        if value is not None:
            found.append((_spec(field, **{kind: value}), field))
    if len(found) > 1:
        raise bad_request(
            f"give one structured-output constraint, not {', '.join(f for _, f in found)}",
            found[1][1].split(".")[0],
        )
    return found[0] if found else None


async def compile_structure(
    grammars: GrammarCompiler, spec: StructuredOutputsParams, field: str, metrics: StructuredMetrics
) -> None:
    """Compile (or find cached) off the event loop and the engine thread; a 400 if it does not compile.
    Counts the request by kind (``tool_calls`` for a forced tool call)."""
    try:
        await asyncio.wrap_future(grammars.compile(spec))
    except GrammarError as err:
        raise bad_request(f"{field}: {err}", err.keyword or field) from None
    metrics.request("tool_calls" if field == "tools" else spec.kind)


def _spec(field: str, **kwargs: Any) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**kwargs)
    except StructuredOutputsError as err:
        raise bad_request(f"{field}: {err}", field if err.param in (None, *KINDS) else err.param) from None


def _response_format(fmt: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind != "json_schema":
        raise bad_request(
            f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
            "response_format.type",
        )
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object", "response_format.json_schema")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise bad_request(
            "response_format.json_schema.name must be 1-64 letters, digits, '_' or '-'",
            "response_format.json_schema.name",
        )
    if spec.get("strict") is not None and not isinstance(spec.get("strict"), bool):
        raise bad_request(
            "response_format.json_schema.strict must be a boolean", "response_format.json_schema.strict"
        )
    schema = spec.get("schema")
    if schema is None:
        return StructuredOutputsParams(json_object=True)
    if not isinstance(schema, (dict, bool)):
        raise bad_request(
            "response_format.json_schema.schema must be a JSON schema object",
            "response_format.json_schema.schema",
        )
    return _spec("response_format.json_schema.schema", json=schema)


def _structured_outputs(value: dict[str, Any]) -> StructuredOutputsParams:
    known = {*KINDS, "disable_any_whitespace"}
    unsupported = sorted(k for k in value if k not in known and k not in _BACKEND_KEYS)
    if unsupported:
        raise bad_request(
            f"structured_outputs.{unsupported[0]} is not supported (supported: {', '.join(sorted(known))})",
            f"structured_outputs.{unsupported[0]}",
        )
    kwargs = {k: v for k, v in value.items() if k in known and v is not None}
    if not isinstance(kwargs.get("disable_any_whitespace", False), bool):
        raise bad_request(
            "structured_outputs.disable_any_whitespace must be a boolean",
            "structured_outputs.disable_any_whitespace",
        )
    try:
        return StructuredOutputsParams(**kwargs)
    except StructuredOutputsError as err:
        param = "structured_outputs" + (
            f".{err.param}" if err.param not in (None, "structured_outputs") else ""
        )
        raise bad_request(f"structured_outputs: {err}", param) from None
