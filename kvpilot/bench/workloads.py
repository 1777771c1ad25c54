"""Request streams: what each benchmark request asks for (prompt, output length, tenant).

Three workloads, all deterministic for a given seed and endless (the runner takes as many as it needs):
- ``random``: prompt of a uniform random word count in ``input_len_range``, ``max_tokens`` uniform in
  ``output_len_range``.
- ``shared-prefix``: ``num_tenants`` tenants, each with one fixed system prompt of ``system_prompt_len``
  words shared by all its requests (the prefix-cache case), then a random user part as above; requests pick
  a tenant uniformly at random and carry it (``x-tenant`` header and ``user`` field). The system prompts
  are drawn once per :class:`Workload` (from ``tenant_seed``), so every stream of it shares them.
- ``sharegpt``: prompts of a ShareGPT-style file in a seeded random order (reshuffled when used up), with
  ``max_tokens`` = the words of the recorded answer, capped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from kvpilot.bench.config import WorkloadConfig
from kvpilot.bench.sharegpt import ConversationTurnPair, load_sharegpt
from kvpilot.bench.wordlist import random_words


@dataclass(frozen=True)
class RequestSpec:
    index: int  # position in the stream (0-based)
    prompt: str  # the user text
    max_tokens: int  # requested output length
    prompt_words: (
        int  # words in system prompt + prompt: the estimate of prompt tokens when no usage comes back
    )
    system_prompt: str | None = None  # the tenant's shared prefix (shared-prefix workload)
    tenant: str | None = None  # tenant id (shared-prefix workload)


class Workload:
    """Builds seeded request streams for one workload config; a dataset file is read once, here."""

    def __init__(self, config: WorkloadConfig, tenant_seed: np.random.SeedSequence | int = 0):
        self.config = config
        self._pairs: list[ConversationTurnPair] = []
        self.system_prompts: list[str] = []  # one per tenant (shared-prefix only)
        if config.kind == "shared-prefix":
            self.system_prompts = tenant_system_prompts(config, np.random.default_rng(tenant_seed))
        if config.kind == "sharegpt":
            if config.dataset_path is None:
                raise ValueError("the sharegpt workload needs a dataset path")
            self._pairs = load_sharegpt(config.dataset_path)
        elif config.kind not in ("random", "shared-prefix"):
            raise ValueError(f"unknown workload {config.kind!r}")

    def stream(self, rng: np.random.Generator) -> Iterator[RequestSpec]:
        """The endless request stream; the same ``rng`` state gives the same requests."""
        if self.config.kind == "random":
            return _random_stream(self.config, rng)
        if self.config.kind == "shared-prefix":
            return _shared_prefix_stream(self.config, self.system_prompts, rng)
        return _sharegpt_stream(self._pairs, self.config.sharegpt_output_cap, rng)


def _uniform(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    low, high = bounds
    return int(rng.integers(low, high + 1))


def _random_stream(config: WorkloadConfig, rng: np.random.Generator) -> Iterator[RequestSpec]:
    index = 0
    while True:
        words = _uniform(rng, config.input_len_range)
        max_tokens = _uniform(rng, config.output_len_range)
        yield RequestSpec(
            index=index, prompt=random_words(rng, words), max_tokens=max_tokens, prompt_words=words
        )
        index += 1


def tenant_system_prompts(config: WorkloadConfig, rng: np.random.Generator) -> list[str]:
    """One system prompt per tenant; each opens with its tenant name so no two share even a first block."""
    return [f"tenant-{t}: " + random_words(rng, config.system_prompt_len) for t in range(config.num_tenants)]


def _shared_prefix_stream(
    config: WorkloadConfig, system_prompts: list[str], rng: np.random.Generator
) -> Iterator[RequestSpec]:
    # "tenant-k:" adds one word to each system prompt.
    system_words = config.system_prompt_len + 1
    index = 0
    while True:
        tenant = int(rng.integers(0, config.num_tenants))
        words = _uniform(rng, config.input_len_range)
        max_tokens = _uniform(rng, config.output_len_range)
        yield RequestSpec(
            index=index,
            prompt=random_words(rng, words),
            max_tokens=max_tokens,
            prompt_words=system_words + words,
            system_prompt=system_prompts[tenant],
            tenant=f"tenant-{tenant}",
        )
        index += 1


def _sharegpt_stream(
    pairs: list[ConversationTurnPair], output_cap: int, rng: np.random.Generator
) -> Iterator[RequestSpec]:
    index = 0
    while True:
        for position in rng.permutation(len(pairs)):
            pair = pairs[int(position)]
            max_tokens = max(1, min(pair.answer_words, output_cap))
            yield RequestSpec(
                index=index, prompt=pair.prompt, max_tokens=max_tokens, prompt_words=len(pair.prompt.split())
            )
            index += 1
