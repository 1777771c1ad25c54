"""What the operator admits, the engine it starts accepts: the spec's rules checked against the engine's own
argument parser (``kvpilot serve``), so the two cannot drift apart into pods that exit 2 at every start."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from kubernetes.utils import parse_quantity

from kvpilot.engine.arg_utils import config_from_namespace
from kvpilot.engine.server.cli import build_parser
from kvpilot.operator.crd_rules import OPERATOR_OWNED_OPTIONS
from kvpilot.operator.fetch import add_arguments as add_fetch_arguments
from kvpilot.operator.model_delivery import fetch_args
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


def fetch_accepts(args: list[str]) -> bool:
    parser = argparse.ArgumentParser()
    add_fetch_arguments(parser)
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            parser.parse_args(args)
        except SystemExit:
            return False
    return True


@pytest.mark.parametrize(
    ("quantity", "admitted"), [("0", False), ("500m", False), ("1", True), ("1.5", True), ("10Gi", True)]
)
def test_a_fetched_sources_size_limit_is_admitted_exactly_when_its_init_container_takes_it(
    quantity, admitted
):
    body = manifest({})
    body["spec"]["model"] = {"source": "https://models.example/m.gguf", "sizeLimit": quantity}
    try:
        isvc = InferenceService.from_manifest(body)
    except SpecError as error:
        assert (admitted, error.field) == (False, "spec.model.sizeLimit")
        assert error.message.startswith("model.sizeLimit must be at least 1 byte")
        return
    assert admitted
    assert fetch_accepts(fetch_args(isvc.spec.model))


@pytest.mark.parametrize(
    ("quantity", "admitted"), [("0", False), ("100m", False), ("1", True), ("2Gi", True)]
)
def test_a_scratch_volume_under_one_byte_is_refused(quantity, admitted):
    body = manifest({})
    body["spec"]["model"]["cacheSize"] = quantity
    try:
        InferenceService.from_manifest(body)
    except SpecError as error:
        assert (admitted, error.field, error.message[:39]) == (
            False,
            "spec.model.cacheSize",
            "model.cacheSize must be at least 1 byte",
        )
        return
    assert admitted


def rendered_options(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of the engine flags the operator renders, over specs that render each of them."""
    cpu = manifest({"enablePrefixCaching": False, "enableChunkedPrefill": False})
    gpu = manifest(
        {
            "kvCacheDtype": "fp8",
            "activationQuantization": "fp8",
            "speculative": {"method": "ngram", "numSpeculativeTokens": 2},
        }
    )
    gpu["spec"]["model"]["quantization"] = "fp8"
    gpu["spec"]["resources"] = {"gpus": 2, "memory": "16Gi"}
    flags = {
        arg
        for body in (manifest({}), cpu, gpu)
        for arg in engine_args(InferenceService.from_manifest(body))
        if arg.startswith("-")
    }
    return {
        option
        for action in parser._actions
        if flags & set(action.option_strings)
        for option in action.option_strings
    }


def test_the_owned_options_are_every_spelling_of_every_rendered_flag_in_the_engine_parser():
    # aliases included: -q is --quantization, -tp is --tensor-parallel-size
    assert rendered_options(build_parser()) == set(OPERATOR_OWNED_OPTIONS)


def _dests_set_by(parser: argparse.ArgumentParser, arg: str) -> set[str]:
    """The destinations ``arg`` (followed by a value) sets, or none when the parser refuses it."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        try:
            namespace, _ = parser.parse_known_args([arg, "7"])
        except SystemExit:
            return set()
    defaults = parser.parse_known_args([])[0]
    return {dest for dest, value in vars(namespace).items() if value != getattr(defaults, dest)}


@pytest.mark.parametrize("allow_abbrev", [False, True])  # True: engine images from before the fix
def test_every_argument_the_engine_reads_as_an_owned_flag_is_refused_and_no_other(allow_abbrev):
    parser = build_parser()
    parser.allow_abbrev = allow_abbrev
    for action in parser._actions:  # any value goes, so that only the spelling decides
        action.type, action.choices = None, None
    owned = {
        action.dest for action in parser._actions if set(action.option_strings) & set(OPERATOR_OWNED_OPTIONS)
    }
    options = [option for action in parser._actions for option in action.option_strings]
    spellings = {option[:end] for option in options for end in range(2, len(option) + 1)}
    spellings |= {f"{s}=7" for s in set(spellings)} | {f"{option}7" for option in options}
    overriding = {arg for arg in spellings if _dests_set_by(parser, arg) & owned}
    assert {"-tp", "-t", "-q", "-q7", "-tp=7", "--served-model-name=7"} <= overriding
    assert ({"--served-model", "--por=7", "--mod"} <= overriding) is allow_abbrev
    refused = {arg for arg in overriding if not _admitted([arg])}
    assert refused == overriding
    others = [o for o in options if o not in OPERATOR_OWNED_OPTIONS and o != "-h"]
    assert len(others) > 30 and all(_admitted([o]) and _admitted([f"{o}=7"]) for o in others)


def _admitted(extra_args: list[str]) -> bool:
    try:
        InferenceService.from_manifest(manifest({"extraArgs": extra_args}))
    except SpecError as error:
        assert error.field == "spec.engine.extraArgs"
        return False
    return True


def test_the_probes_extra_args_no_longer_override_the_spec():
    for arg in ("-tp", "-q", "--served-model", "--por", "--mod", "--max-num-batched", "--block", "-qint8"):
        assert not _admitted([arg, "4"]), arg
    # a value with a newline still names its flag, in Python as in RE2 (where $ is the end of the text)
    assert not _admitted(["--served-model-name=a\nb"])
    assert _admitted(["--seed", "7", "--max-model-len=512", "--enforce-eager"])
