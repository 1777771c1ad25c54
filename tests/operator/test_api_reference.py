"""docs/api-reference.md is the output of scripts/api_reference.py (so it cannot go stale), and every field
of the CRD it documents has a description, a type, and its default and validation shown."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from kvpilot.operator.crd import openapi_schema
from kvpilot.operator.crd_schema import ROUTER_WEIGHT_DESCRIPTIONS, ROUTER_WEIGHT_KEYS

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "api-reference.md"


def _load_generator():
    spec = importlib.util.spec_from_file_location("api_reference", REPO / "scripts" / "api_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _load_generator()


def all_fields() -> list[tuple[str, dict]]:
    root = openapi_schema()["properties"]
    return [*generator.fields_of("spec", root["spec"]), *generator.fields_of("status", root["status"])]


def test_committed_reference_is_the_generated_one():
    assert DOC.read_text(encoding="utf-8") == generator.render(), (
        "regenerate: .venv/bin/python scripts/api_reference.py > docs/api-reference.md"
    )
    assert generator.main(["--check"]) == 0


def test_every_field_has_a_description():
    undescribed = [path for path, field in all_fields() if not field.get("description", "").strip()]
    assert undescribed == []
    assert len(all_fields()) > 80  # spec and status, nested objects and array items included


def test_router_weight_descriptions_cover_exactly_the_routers_knobs():
    assert tuple(ROUTER_WEIGHT_DESCRIPTIONS) == ROUTER_WEIGHT_KEYS


def _rows() -> dict[str, list[str]]:
    """'section.field' -> the cells of its row, read back from the committed Markdown."""
    rows, section = {}, None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if line.startswith("### "):
            section = line[4:].strip("`")
        elif line.startswith("| `") and section:
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows[f"{section}.{cells[0].split('`')[1]}"] = cells
    return rows


def test_every_field_has_a_row_with_its_type_default_and_validation():
    rows = _rows()
    assert set(rows) == {path for path, _ in all_fields()}
    for path, field in all_fields():
        _name, kind, default, validation, description = rows[path]
        assert generator.type_of(field) in kind, path
        if "default" in field:
            assert default, f"{path}: default not shown"
        if any(k in field for k in ("enum", "minimum", "maximum", "pattern", "maxLength", "maxItems")):
            assert validation, f"{path}: validation not shown"
        assert " ".join(field["description"].split()) == description.replace("\\|", "|"), path
    assert rows["spec.model.source"][0] == "`source` (required)"
    assert rows["spec.engine.blockSize"][2:4] == ["`16`", "one of `8`, `16`, `32`, `64`, `128`"]
    assert rows["spec.engine.gpuMemoryUtilization"][2:4] == ["`0.9`", "0 < x ≤ 1"]
    assert rows["spec.resources.memory"][2] == '`"8Gi"`'
    assert "Kubernetes quantity" in rows["spec.resources.memory"][3]
    assert rows["spec.router.weights.prefill"][4].endswith("Unset: the router's 2.")
    # a pattern with alternatives keeps its pipes inside the cell
    assert r"smollm2-135m\|tiny-random" in rows["spec.model.source"][3]


def test_cross_field_rules_and_links_are_in_the_reference():
    text = DOC.read_text(encoding="utf-8")
    for rule in ("set either scaling.replicas or scaling.targetRequestsPerSecond, not both",):
        assert f"`spec.scaling.replicas`: {rule}" in text
    headings = {
        generator.anchor(line[4:].strip("`")) for line in text.splitlines() if line.startswith("### ")
    }
    links = set(re.findall(r"\]\(#([a-z0-9_-]+)\)", text))
    assert links and links <= headings


@pytest.mark.parametrize(
    ("schema", "checks"),
    [
        ({"type": "number", "minimum": 0, "maximum": 1, "exclusiveMinimum": True}, ["0 < x ≤ 1"]),
        ({"type": "integer", "minimum": 0}, ["x ≥ 0"]),
        ({"type": "string", "minLength": 1, "maxLength": 8}, ["1–8 characters"]),
        ({"type": "string", "enum": ["a", "b"]}, ["one of `a`, `b`"]),
        (
            {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 3}},
            ["at most 2 items", "each item: at most 3 characters"],
        ),
        ({"type": "object", "additionalProperties": False, "properties": {}}, ["no other keys"]),
    ],
)
def test_validation_wording(schema, checks):
    assert generator.validation_of(schema) == checks
