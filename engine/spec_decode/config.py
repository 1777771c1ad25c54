"""``speculative_config``: vLLM's engine argument, a JSON object (``--speculative-config '{...}'``), validated
into a typed ``SpeculativeConfig`` (docs/architecture.md#speculative-decoding).

Accepted keys (vLLM's names): ``method`` (``ngram`` or ``draft_model``), ``num_speculative_tokens``,
``prompt_lookup_min`` and ``prompt_lookup_max`` (``ngram``), ``model`` (``draft_model``: a model name or path
with the target's tokenizer), ``disable_by_batch_size``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvpilot.engine.spec_decode.ngram_proposer import NgramConfig

METHODS = ("ngram", "draft_model")
_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
)
#: above this many decoding sequences speculation stops paying on SmolLM2 on a 2-core CPU (x1.07-1.23 at
#: 4, x0.92-0.97 at 8: bench/results/spec_decode.md)
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


@dataclass(frozen=True)
class SpeculativeConfig:
    #: the proposer: ``ngram`` (prompt lookup) or ``draft_model``
    method: str
    #: ``num_speculative_tokens`` and, for ``ngram``, the prompt-lookup window
    ngram: NgramConfig
    #: speculation is off for a step whose batch has more decoding sequences than this (the step is then
    #: compute-bound: verifying drafts costs more than the tokens they save)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    #: ``draft_model``: the draft's model name or path (same tokenizer as the target)
    model: str | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return self.ngram.num_speculative_tokens


def parse_speculative_config(
    value: str | dict[str, Any] | SpeculativeConfig | None,
) -> SpeculativeConfig | None:
    """A JSON string or dict → ``SpeculativeConfig`` (None stays None). Raises ``ValueError`` naming the
    bad key or value."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ValueError(f"speculative_config is not valid JSON: {err}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
    unknown = sorted(set(value) - set(_KEYS))
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; accepted: {list(_KEYS)}")
    method = value.get("method", "ngram")
    if method not in METHODS:
        raise ValueError(f"speculative_config: method must be one of {METHODS}, got {method!r}")
    if "num_speculative_tokens" not in value:
        raise ValueError("speculative_config: num_speculative_tokens is required")
    ints = {}
    for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "disable_by_batch_size"):
        if key in value:
            v = value[key]
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"speculative_config: {key} must be an integer, got {v!r}")
            ints[key] = v
    if ints["num_speculative_tokens"] > 16:
        raise ValueError("speculative_config: num_speculative_tokens must be <= 16")
    lookup_max = ints.get("prompt_lookup_max", max(4, ints.get("prompt_lookup_min", 1)))
    lookup_min = ints.get("prompt_lookup_min", min(1, lookup_max))
    ngram = NgramConfig(ints["num_speculative_tokens"], lookup_min, lookup_max)
    disable = ints.get("disable_by_batch_size", DEFAULT_DISABLE_BY_BATCH_SIZE)
    if disable < 1:
        raise ValueError(f"speculative_config: disable_by_batch_size must be >= 1, got {disable}")
    model = value.get("model")
    if method == "draft_model" and (not isinstance(model, str) or not model):
        raise ValueError("speculative_config: method 'draft_model' needs 'model', the draft's name or path")
    if method == "ngram" and model is not None:
        raise ValueError("speculative_config: 'model' belongs to method 'draft_model', not 'ngram'")
    return SpeculativeConfig(method, ngram, disable, model)
