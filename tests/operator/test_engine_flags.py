"""What the operator admits, the engine it starts accepts: the spec's rules checked against the engine's own
argument parser (``kvpilot serve``), so the two cannot drift apart into pods that exit 2 at every start."""

from __future__ import annotations

import contextlib
import io

import pytest
from kubernetes.utils import parse_quantity

from kvpilot.engine.arg_utils import config_from_namespace
from kvpilot.engine.server.cli import build_parser
from kvpilot.operator.pod_template import engine_args
from kvpilot.operator.spec import InferenceService, SpecError

KV_MESSAGE = (
    "engine.kvCacheMemory must be at least 1 byte: the engine takes its KV budget as a positive whole "
    "number of bytes (--kv-cache-memory-bytes), e.g. 2Gi"
)


def manifest(engine: dict) -> dict:
    return {
        "apiVersion": "kvpilot.dev/v1alpha1",
        "kind": "InferenceService",
        "metadata": {"name": "m", "namespace": "ml"},
        "spec": {"model": {"source": "tiny-random"}, "engine": engine},
    }


def engine_accepts(args: list[str]) -> bool:
    parser = build_parser()
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            config_from_namespace(parser, parser.parse_args(args))
        except SystemExit:
            return False
    return True


@pytest.mark.parametrize(
    ("quantity", "admitted"),
    [
        ("0", False),
        ("0.5", False),
        ("100m", False),
        ("999m", False),
        ("1", True),
        ("1.5", True),
        ("1e3", True),
        ("512Mi", True),
    ],
)
def test_kv_cache_memory_is_admitted_exactly_when_the_engine_takes_it(quantity, admitted):
    # the operator renders the quantity as whole bytes (spec.kv_cache_memory_bytes)
    rendered = ["--model", "tiny-random", "--kv-cache-memory-bytes", str(int(parse_quantity(quantity)))]
    assert engine_accepts(rendered) is admitted
    try:
        isvc = InferenceService.from_manifest(manifest({"kvCacheMemory": quantity}))
    except SpecError as error:
        assert (admitted, error.field) == (False, "spec.engine.kvCacheMemory")
        assert error.message == KV_MESSAGE
        return
    assert admitted
    assert engine_accepts(engine_args(isvc))
