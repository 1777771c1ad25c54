"""Write docs/api-reference.md: every field of the InferenceService CRD, from the CRD the operator generates.

    .venv/bin/python scripts/api_reference.py > docs/api-reference.md     # regenerate
    .venv/bin/python scripts/api_reference.py --check                     # exit 1 when the doc is stale

The source is ``kvpilot.operator.crd.crd_manifest()``, i.e. ``operator/crd_schema.py`` (types, bounds,
enums, defaults, descriptions) and ``operator/crd_rules.py`` (the CEL rules), exactly as the API server
gets them from ``crds/``. tests/operator/test_api_reference.py keeps the committed doc equal to this
output and every field described.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvpilot.operator import api_names
from kvpilot.operator.crd import crd_manifest
from kvpilot.operator.crd_schema import DNS_LABEL_PATTERN, QUANTITY_PATTERN

DOC = Path(__file__).resolve().parents[1] / "docs" / "api-reference.md"
#: patterns with a name a reader knows, shown by that name instead of the regular expression
NAMED_PATTERNS = {
    QUANTITY_PATTERN: "a Kubernetes quantity without a sign (`500m`, `2`, `8Gi`, `1e9`)",
    DNS_LABEL_PATTERN: "a DNS label (lower-case alphanumerics and `-`)",
}


def _code(text: Any) -> str:
    rendered = str(text)
    fence = "``" if "`" in rendered else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{rendered}{pad}{fence}"


def _cell(text: str) -> str:
    """One table cell: a single line, pipes escaped (GitHub wants that even inside code spans)."""
    return " ".join(text.replace("|", "\\|").split())


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and value.is_integer():
        return f"{value:g}"
    if isinstance(value, str):
        return f'"{value}"'
    if value == {}:
        return "{}"
    if value == []:
        return "[]"
    return str(value)


def type_of(schema: dict[str, Any]) -> str:
    kind = schema.get("type", "any")
    if kind == "array":
        return "[]" + type_of(schema.get("items", {}))
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return "map[string]" + type_of(schema["additionalProperties"])
    if "format" in schema:
        return f"{kind} ({schema['format']})"
    return kind


def _bounds(schema: dict[str, Any]) -> str | None:
    low, high = schema.get("minimum"), schema.get("maximum")
    if low is None and high is None:
        return None
    low_op = "<" if schema.get("exclusiveMinimum") else "≤"
    high_op = "<" if schema.get("exclusiveMaximum") else "≤"
    if low is not None and high is not None:
        return f"{_scalar(low)} {low_op} x {high_op} {_scalar(high)}"
    if low is not None:
        return f"x {'>' if low_op == '<' else '≥'} {_scalar(low)}"
    return f"x {high_op} {_scalar(high)}"


def validation_of(schema: dict[str, Any]) -> list[str]:
    """What the API server checks on this field's value, in words (nested objects list their own)."""
    checks: list[str] = []
    if "enum" in schema:
        checks.append("one of " + ", ".join(_code(_scalar(v).strip('"')) for v in schema["enum"]))
    bounds = _bounds(schema)
    if bounds:
        checks.append(bounds)
    if "minLength" in schema and "maxLength" in schema:
        checks.append(f"{schema['minLength']}–{schema['maxLength']} characters")
    elif "maxLength" in schema:
        checks.append(f"at most {schema['maxLength']} characters")
    elif "minLength" in schema:
        checks.append(f"at least {schema['minLength']} characters")
    if "pattern" in schema:
        pattern = schema["pattern"]
        checks.append(NAMED_PATTERNS.get(pattern) or "matches " + _code(pattern))
    if "maxItems" in schema:
        checks.append(f"at most {schema['maxItems']} items")
    if "maxProperties" in schema:
        checks.append(f"at most {schema['maxProperties']} keys")
    if schema.get("additionalProperties") is False:
        checks.append("no other keys")
    if schema.get("x-kubernetes-list-type") == "map":
        keys = ", ".join(schema.get("x-kubernetes-list-map-keys", []))
        checks.append(f"one item per {keys}")
    for sub, label in (("items", "each item"), ("additionalProperties", "each value")):
        inner = schema.get(sub)
        if isinstance(inner, dict) and inner.get("type") != "object":
            checks.extend(f"{label}: {check}" for check in validation_of(inner))
    return checks


def default_of(schema: dict[str, Any]) -> str:
    if "default" not in schema:
        return ""
    default = schema["default"]
    if default == {} and schema.get("type") == "object":
        return "{} (its fields' defaults apply)"
    return _code(_scalar(default))


def _object_of(schema: dict[str, Any]) -> dict[str, Any] | None:
    """The object schema a field holds (itself, or its array's items), if it has documented fields."""
    if schema.get("type") == "object" and "properties" in schema:
        return schema
    items = schema.get("items")
    if schema.get("type") == "array" and isinstance(items, dict):
        return _object_of(items)
    return None


def _path_of_items(path: str, schema: dict[str, Any]) -> str:
    return path + "[]" if schema.get("type") == "array" else path


def anchor(path: str) -> str:
    """GitHub's anchor of a heading that is one code span: lower case, punctuation but `-` and `_` dropped."""
    return "".join(ch for ch in path.lower() if ch.isalnum() or ch in "-_")


def objects(path: str, schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, object schema) for this object and every object below it, depth first in field order."""
    yield path, schema
    for name, field in schema.get("properties", {}).items():
        inner = _object_of(field)
        if inner is not None:
            yield from objects(_path_of_items(f"{path}.{name}", field), inner)


def fields_of(path: str, schema: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, schema) of every field at or below ``path``: what the 'every field is described' test walks."""
    for name, field in schema.get("properties", {}).items():
        field_path = f"{path}.{name}"
        yield field_path, field
        inner = _object_of(field)
        if inner is not None:
            yield from fields_of(_path_of_items(field_path, field), inner)


def _field_row(path: str, name: str, field: dict[str, Any], required: bool) -> str:
    inner = _object_of(field)
    label = f"`{name}`" + (" (required)" if required else "")
    kind = type_of(field)
    if inner is not None:
        target = _path_of_items(f"{path}.{name}", field)
        kind = f"[{kind}](#{anchor(target)})"
    checks = "; ".join(validation_of(field))
    description = field.get("description", "")
    return f"| {label} | {kind} | {default_of(field)} | {_cell(checks)} | {_cell(description)} |"


def _object_section(path: str, schema: dict[str, Any]) -> list[str]:
    lines = [f"### `{path}`", ""]
    if schema.get("description"):
        lines += [" ".join(schema["description"].split()), ""]
    required = set(schema.get("required", []))
    lines += ["| field | type | default | validation | description |", "|---|---|---|---|---|"]
    lines += [_field_row(path, name, f, name in required) for name, f in schema["properties"].items()]
    rules = schema.get("x-kubernetes-validations", [])
    if rules:
        lines += ["", "Rules across fields (CEL at admission; the operator checks the same rule):", ""]
        for rule in rules:
            lines.append(f"- `{path}{rule['fieldPath']}`: {rule['message']} — {_code(rule['rule'])}")
    return [*lines, ""]


def render() -> str:
    crd = crd_manifest()
    spec = crd["spec"]
    version = spec["versions"][0]
    root = version["schema"]["openAPIV3Schema"]
    names = spec["names"]
    lines = [
        "# InferenceService API reference",
        "",
        "<!-- Generated by scripts/api_reference.py from operator/crd_schema.py and operator/crd_rules.py;",
        "     do not edit: run `.venv/bin/python scripts/api_reference.py > docs/api-reference.md`. -->",
        "",
        f"{root['description']} API version `{api_names.API_VERSION}`, kind `{names['kind']}`, "
        f"{spec['scope'].lower()}; plural `{names['plural']}`, short name "
        + ", ".join(f"`{n}`" for n in names["shortNames"])
        + f", category `{', '.join(names['categories'])}`; the status is a subresource (only the operator "
        "writes it). CRD: `crds/inferenceservices.kvpilot.dev.yaml` (also in the Helm chart).",
        "",
        "Defaults are applied by the API server when an object is stored (and by the operator for objects an "
        "older CRD let in), so `kubectl get kvis NAME -o yaml` shows every defaulted field. An object block "
        "whose default is `{}` may be left out: its fields' defaults apply. Unknown fields are pruned, and "
        "`kubectl apply` (server-side field validation) refuses them. A spec the operator finds invalid is "
        "reported as phase `Failed` with condition reason `InvalidSpec`, naming the field; nothing is "
        "changed in the cluster until it is fixed.",
        "",
        "`kubectl get kvis` columns: "
        + ", ".join(f"{c['name']} (`{c['jsonPath']}`)" for c in version["additionalPrinterColumns"])
        + ".",
        "",
        "`apiVersion`, `kind` and `metadata` are Kubernetes' own. Example: "
        "[manifests/examples/smollm2-cpu.yaml](../manifests/examples/smollm2-cpu.yaml).",
        "",
        "## Contents",
        "",
    ]
    sections: list[tuple[str, list[tuple[str, dict[str, Any]]]]] = [
        ("Spec", list(objects("spec", root["properties"]["spec"]))),
        ("Status", list(objects("status", root["properties"]["status"]))),
    ]
    for title, entries in sections:
        links = ", ".join(f"[`{path}`](#{anchor(path)})" for path, _ in entries)
        lines.append(f"- {title}: {links}")
    lines.append("")
    for title, entries in sections:
        lines += [f"## {title}", ""]
        for path, schema in entries:
            lines += _object_section(path, schema)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help=f"compare with {DOC} instead of printing")
    args = parser.parse_args(argv)
    text = render()
    if not args.check:
        sys.stdout.write(text)
        return 0
    if DOC.read_text(encoding="utf-8") == text:
        return 0
    print(
        f"{DOC} is stale: run .venv/bin/python scripts/api_reference.py > docs/api-reference.md",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
