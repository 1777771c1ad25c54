"""Cross-field rules of the InferenceService spec, each written once in two forms.

A rule's CEL text goes into the CRD (``x-kubernetes-validations``) so a real API server refuses a bad
object at ``kubectl apply`` time; its Python predicate runs in the operator (and in ``render``) so that
clusters that do not evaluate CEL, and the e2e harness, still report the same rule by the same message.
Keeping both next to each other is what keeps them saying the same thing.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from kubernetes.utils import parse_quantity

from kvpilot.operator.model_source import SINGLE_FILE_PATTERN

# Every option string of the engine flags the operator derives from the spec, aliases included (the list is
# checked against `kvpilot serve`'s own parser by tests/operator/test_engine_flags.py; the operator does not
# import the engine). Repeating one in extraArgs would silently override the spec.
OPERATOR_OWNED_OPTIONS = (
    "--model",
    "--port",
    "--served-model-name",
    "--dtype",
    "--block-size",
    "--max-num-seqs",
    "--max-num-batched-tokens",
    "--kv-cache-memory-bytes",
    "--gpu-memory-utilization",
    "--slo-ttft",
    "--slo-tpot",
    "--enable-prefix-caching",
    "--no-enable-prefix-caching",
    "--enable-chunked-prefill",
    "--no-enable-chunked-prefill",
    "--speculative-config",
    "--kv-cache-dtype",
    "--quantization",
    "-q",
    "--activation-quantization",
    "--tensor-parallel-size",
    "-tp",
)
# Multi-node pipeline parallelism (LeaderWorkerSet) is the next step after tensor parallelism: until the
# engine has it, asking for it (vLLM's spelling) is refused in the spec instead of failing every pod's start.
PIPELINE_OPTIONS = ("--pipeline-parallel-size", "-pp")


def _prefixes(node: dict[str, Any]) -> tuple[str, bool]:
    """A regex for any non-empty path from the root of a character trie, and whether it is one group."""
    parts = []
    for char, child in sorted(node.items()):
        rest, grouped = _prefixes(child) if child else ("", False)
        parts.append(char + (rest + "?" if grouped else f"(?:{rest})?" if rest else ""))
    return (parts[0], False) if len(parts) == 1 else ("(?:" + "|".join(parts) + ")", True)


def _any_prefix(words: list[str]) -> str:
    trie: dict[str, Any] = {}
    for word in words:
        assert re.fullmatch("[a-z0-9-]+", word), word  # literal in RE2 and Python alike, no escaping
        node = trie
        for char in word:
            node = node.setdefault(char, {})
    return _prefixes(trie)[0]


def _spellings(options: tuple[str, ...]) -> str:
    """Every argument argparse may read as one of ``options``: the option itself, ``option=value``, any
    prefix abbreviation (engine images from before ``allow_abbrev=False`` take those) and, for a one-letter
    option, its value glued on (``-qint8``)."""
    glued = [o for o in options if len(o) == 2 and o[1] != "-"]
    single = [o[1:] for o in options if o[1] != "-" and o not in glued]
    forms = [f"--{_any_prefix([o[2:] for o in options if o[1] == '-'])}(?:=.*)?"]
    forms += [f"-{_any_prefix(single)}(?:=.*)?"] if single else []
    return "|".join(forms + [f"{o}.*" for o in glued])


def _whole(alternatives: str) -> tuple[str, re.Pattern[str]]:
    """The CEL (RE2) regex matching a whole argument, and its Python twin. RE2's ``$`` is the end of the
    text while Python's also matches before a final newline, so Python uses fullmatch; ``(?s)`` lets ``.``
    cross newlines in both (a value with a newline in it still names the flag)."""
    return f"(?s)^(?:{alternatives})$", re.compile(f"(?s)(?:{alternatives})")


OWNED_FLAG_PATTERN, _OWNED_FLAG = _whole(_spellings(OPERATOR_OWNED_OPTIONS))
PIPELINE_FLAG_PATTERN, _PIPELINE_FLAG = _whole("(?:--pipeline-parallel-size|-pp)(?:=.*)?")


def refuses_flag(pattern: re.Pattern[str], args: list[str]) -> bool:
    return any(pattern.fullmatch(arg) for arg in args)


# The KV budget of a CPU pod whose spec sets none (the engine's own CPU default); a GPU pod without one
# sizes its cache from engine.gpuMemoryUtilization instead.
CPU_KV_CACHE_MEMORY = "1Gi"


@dataclass(frozen=True)
class CrossFieldRule:
    """A rule on one object of the spec (``node``), reported at ``node + field``."""

    node: tuple[str, ...]  # path from the CR root to the object the rule is attached to
    field: str  # the field the message is about, relative to node (CEL fieldPath without the dot)
    cel: str
    message: str
    holds: Callable[[Mapping[str, Any]], bool]  # True when the (defaulted) node satisfies the rule

    @property
    def field_path(self) -> str:
        """Dotted path from the CR root, as Kubernetes names fields in its error messages."""
        return ".".join((*self.node, *self.field.split(".")))


def _cel_string(pattern: str) -> str:
    """A regular expression as a single-quoted CEL string literal (backslashes escaped)."""
    return "'" + pattern.replace("\\", "\\\\") + "'"


def _quantity_less(smaller: str, larger: str) -> bool:
    return parse_quantity(smaller) < parse_quantity(larger)


def _at_least_one_byte(node: tuple[str, ...], field: str, message: str) -> CrossFieldRule:
    """An optional quantity at ``node``'s ``field`` of at least one byte."""
    return CrossFieldRule(
        node=node,
        field=field,
        cel=f"!has(self.{field}) || !quantity(self.{field}).isLessThan(quantity('1'))",
        message=message,
        holds=lambda spec: field not in spec or parse_quantity(spec[field]) >= 1,
    )


RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        node=("spec", "scaling"),
        field="replicas",
        cel="!(has(self.replicas) && has(self.targetRequestsPerSecond))",
        message="set either scaling.replicas or scaling.targetRequestsPerSecond, not both",
        holds=lambda s: not ("replicas" in s and "targetRequestsPerSecond" in s),
    ),
    CrossFieldRule(
        node=("spec",),
        field="scaling.perReplicaGoodput",
        cel="has(self.scaling.targetRequestsPerSecond) == has(self.scaling.perReplicaGoodput) || "
        "(self.autoscaling.mode == 'operator' && has(self.scaling.perReplicaGoodput))",
        message="scaling.targetRequestsPerSecond and scaling.perReplicaGoodput are given together "
        "(perReplicaGoodput alone only with autoscaling.mode operator)",
        holds=lambda s: (
            ("targetRequestsPerSecond" in s["scaling"]) == ("perReplicaGoodput" in s["scaling"])
            or (s["autoscaling"]["mode"] == "operator" and "perReplicaGoodput" in s["scaling"])
        ),
    ),
    CrossFieldRule(
        node=("spec",),
        field="autoscaling.mode",
        cel="self.autoscaling.mode != 'operator' || has(self.scaling.perReplicaGoodput)",
        message="autoscaling.mode operator needs scaling.perReplicaGoodput: the goodput per replica "
        "assumed until enough is measured",
        holds=lambda s: s["autoscaling"]["mode"] != "operator" or "perReplicaGoodput" in s["scaling"],
    ),
    CrossFieldRule(
        node=("spec", "scaling"),
        field="minReplicas",
        cel="self.minReplicas <= self.maxReplicas",
        message="scaling.minReplicas must not exceed scaling.maxReplicas",
        holds=lambda s: s["minReplicas"] <= s["maxReplicas"],
    ),
    CrossFieldRule(
        node=("spec",),
        field="model.quantization",
        cel="self.model.quantization != 'fp8' || self.resources.gpus > 0",
        message="model.quantization fp8 keeps e4m3 weights on GPUs: set resources.gpus, or use auto "
        "(an fp8 checkpoint loads dequantized on CPU), none, gguf or int8",
        holds=lambda s: s["model"]["quantization"] != "fp8" or s["resources"]["gpus"] > 0,
    ),
    CrossFieldRule(
        node=("spec",),
        field="engine.activationQuantization",
        cel="self.engine.activationQuantization != 'int8' || "
        "(self.resources.gpus == 0 && self.model.quantization != 'none' && self.model.quantization != 'fp8')",
        message="engine.activationQuantization int8 runs gguf/int8 weights on CPU replicas "
        "(AVX-512 VNNI or AVX2): resources.gpus 0 and model.quantization auto, gguf or int8",
        holds=lambda s: (
            s["engine"]["activationQuantization"] != "int8"
            or (s["resources"]["gpus"] == 0 and s["model"]["quantization"] not in ("none", "fp8"))
        ),
    ),
    CrossFieldRule(
        node=("spec",),
        field="engine.activationQuantization",
        cel="self.engine.activationQuantization != 'fp8' || (self.resources.gpus > 0 && "
        "(self.model.quantization == 'fp8' || self.model.quantization == 'auto'))",
        message="engine.activationQuantization fp8 (W8A8) runs fp8 weights on GPUs: resources.gpus > 0 and "
        "model.quantization fp8 or auto (an fp8 checkpoint)",
        holds=lambda s: (
            s["engine"]["activationQuantization"] != "fp8"
            or (s["resources"]["gpus"] > 0 and s["model"]["quantization"] in ("fp8", "auto"))
        ),
    ),
    CrossFieldRule(
        node=("spec", "engine"),
        field="maxNumBatchedTokens",
        cel="self.maxNumBatchedTokens >= self.maxNumSeqs",
        message="engine.maxNumBatchedTokens must be at least engine.maxNumSeqs (one token per sequence)",
        holds=lambda e: e["maxNumBatchedTokens"] >= e["maxNumSeqs"],
    ),
    CrossFieldRule(
        node=("spec", "engine"),
        field="extraArgs",
        cel=f"self.extraArgs.all(a, !a.matches({_cel_string(OWNED_FLAG_PATTERN)}))",
        message="engine.extraArgs must not repeat a flag the operator sets from the spec, by its name, "
        "an alias (-q, -tp) or an abbreviation",
        holds=lambda e: not refuses_flag(_OWNED_FLAG, e["extraArgs"]),
    ),
    CrossFieldRule(
        node=("spec", "engine"),
        field="extraArgs",
        cel=f"self.extraArgs.all(a, !a.matches({_cel_string(PIPELINE_FLAG_PATTERN)}))",
        message="pipeline parallelism across nodes is not supported yet: a replica runs on one node, and "
        "resources.gpus sets its tensor parallelism over that node's GPUs",
        holds=lambda e: not refuses_flag(_PIPELINE_FLAG, e["extraArgs"]),
    ),
    CrossFieldRule(
        node=("spec", "engine", "speculative"),
        field="draftModel",
        cel="(self.method == 'draft_model') == has(self.draftModel)",
        message="engine.speculative.draftModel is required with method draft_model, and only there",
        holds=lambda s: (s["method"] == "draft_model") == ("draftModel" in s),
    ),
    CrossFieldRule(
        node=("spec", "engine", "speculative"),
        field="promptLookupMin",
        cel="self.promptLookupMin <= self.promptLookupMax",
        message="engine.speculative.promptLookupMin must not exceed promptLookupMax",
        holds=lambda s: s["promptLookupMin"] <= s["promptLookupMax"],
    ),
    CrossFieldRule(
        node=("spec", "resources"),
        field="gpuType",
        cel="!has(self.gpuType) || self.gpus > 0",
        message="resources.gpuType needs resources.gpus > 0",
        holds=lambda r: "gpuType" not in r or r["gpus"] > 0,
    ),
    # The operator renders whole bytes (spec.kv_cache_memory_bytes), and the engine refuses 0: a budget
    # under one byte ("0", "0.5", "100m") would be a pod that exits 2 at every start.
    _at_least_one_byte(
        ("spec", "engine"),
        "kvCacheMemory",
        "engine.kvCacheMemory must be at least 1 byte: the engine takes its KV budget as a positive "
        "whole number of bytes (--kv-cache-memory-bytes), e.g. 2Gi",
    ),
    # rendered as whole bytes into the fetch init container (`fetch-model --size-limit`), which takes a
    # positive number: "0" or "500m" would be a replica whose init container exits 2 at every start
    _at_least_one_byte(
        ("spec", "model"),
        "sizeLimit",
        "model.sizeLimit must be at least 1 byte: it is the most a fetched source may download, e.g. 10Gi",
    ),
    # the scratch volume's sizeLimit and ephemeral-storage request: under one byte, the kubelet would
    # evict the replica as soon as it writes its caches
    _at_least_one_byte(
        ("spec", "model"),
        "cacheSize",
        "model.cacheSize must be at least 1 byte: it sizes each replica's scratch volume, e.g. 10Gi",
    ),
    CrossFieldRule(
        node=("spec",),
        field="engine.kvCacheMemory",
        cel="self.resources.gpus > 0 || quantity(has(self.engine.kvCacheMemory) ? self.engine.kvCacheMemory "
        f": '{CPU_KV_CACHE_MEMORY}').isLessThan(quantity(self.resources.memory))",
        message=f"on CPU the KV cache lives in the pod's memory: engine.kvCacheMemory ({CPU_KV_CACHE_MEMORY} "
        "when unset) must be less than resources.memory",
        holds=lambda s: (
            s["resources"]["gpus"] > 0
            or _quantity_less(s["engine"].get("kvCacheMemory", CPU_KV_CACHE_MEMORY), s["resources"]["memory"])
        ),
    ),
)


_FETCHED = r"^(https?|s3|hf)://"


MODEL_RULES: tuple[CrossFieldRule, ...] = (
    CrossFieldRule(
        node=("spec", "model"),
        field="sha256",
        cel=f"!has(self.sha256) || self.source.matches({_cel_string(SINGLE_FILE_PATTERN)})",
        message="model.sha256 checks one fetched file (an https://, http://, s3:// or hf://.../<file>.gguf "
        "source); pin an hf:// repository by its revision instead (hf://<org>/<name>@<commit>)",
        holds=lambda m: "sha256" not in m or re.match(SINGLE_FILE_PATTERN, m["source"]) is not None,
    ),
    CrossFieldRule(
        node=("spec", "model"),
        field="endpoint",
        cel="!self.source.startsWith('s3://') || has(self.endpoint)",
        message="an s3:// source needs model.endpoint (the S3-compatible endpoint, e.g. "
        "https://minio.storage.svc:9000)",
        holds=lambda m: not m["source"].startswith("s3://") or "endpoint" in m,
    ),
    CrossFieldRule(
        node=("spec", "model"),
        field="credentialsSecret",
        cel=f"!has(self.credentialsSecret) || self.source.matches({_cel_string(_FETCHED)})",
        message="model.credentialsSecret applies only to fetched sources (https://, http://, s3://, hf://)",
        holds=lambda m: "credentialsSecret" not in m or re.match(_FETCHED, m["source"]) is not None,
    ),
)
RULES = RULES + MODEL_RULES


def rules_for(node: tuple[str, ...]) -> list[CrossFieldRule]:
    return [rule for rule in RULES if rule.node == node]
