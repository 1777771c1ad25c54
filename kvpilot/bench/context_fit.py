"""Fitting the workload's lengths to the served model's context, so no request is refused for its length.

A request of W prompt words and ``max_tokens`` O is valid only if its prompt tokens + O fit in the
model's ``max_model_len`` (vLLM and kvpilot answer HTTP 400 otherwise). The word list's words are one
token each in the usual byte-level BPE vocabularies, but not in every tokenizer: tiny-random's spends
3.2 tokens a word on average, 1 to 8 each. So the tokens a word costs are measured on the endpoint
itself: the whole word list in chunks, each sent once for one output token and read back from
``usage.prompt_tokens``, plus the first chunk twice, which gives the tokens every prompt carries besides
its words (BOS, a chat template). Every word of the list is drawn equally often, so the chunks' total is
the mean exactly; a prompt of W words is bounded with room for its spread (which grows as sqrt(W)).

When the configured ranges can draw a request that does not fit, every length (prompt words, the
shared system prompt, max_tokens) is scaled by the one largest factor that fits, so the workload keeps its
shape. ShareGPT prompts are recorded text of their own lengths and are sent as they are.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from kvpilot.bench.config import WorkloadConfig
from kvpilot.bench.endpoint import EndpointError, ServedModel
from kvpilot.bench.sse_client import OpenAIStreamClient, ProbeError
from kvpilot.bench.wordlist import WORDS
from kvpilot.bench.workloads import RequestSpec

PROBE_CHUNK_WORDS = 32  # words per probe: small enough for any context a benchmark can use
# Room for a prompt's spread around the mean, in mean words per sqrt(words): the sum of W random words
# spreads as sqrt(W) times one word's spread, which is 0.45 of the mean in tiny-random's vocabulary, so
# 2 covers over four standard deviations there (and costs a few tokens where every word is one token).
SPREAD_WORDS_PER_ROOT = 2.0


@dataclass(frozen=True)
class TokenRate:
    """Prompt tokens as a function of prompt words, for text drawn from the word list."""

    per_word: float  # mean tokens a word of the list costs
    overhead: float  # tokens every prompt carries besides its words (BOS, chat template)
    measured: bool  # False: the server reports no usage, and one token a word is assumed

    def max_prompt_tokens(self, words: int) -> int:
        """A bound on the tokens of a prompt of ``words`` random words."""
        spread = SPREAD_WORDS_PER_ROOT * math.sqrt(words)
        return math.ceil(self.overhead + self.per_word * (words + spread))


ASSUMED_RATE = TokenRate(per_word=1.0, overhead=0.0, measured=False)


@dataclass(frozen=True)
class ContextFit:
    max_model_len: int  # what the server reports for the model
    rate: TokenRate
    scale: float  # the factor every length was scaled by; 1.0 when the configured lengths fit
    workload: WorkloadConfig  # the lengths actually sent


def longest_request_tokens(config: WorkloadConfig, rate: TokenRate) -> int:
    """A bound on prompt + output tokens of the longest request ``config`` can draw."""
    words = config.input_len_range[1]
    if config.kind == "shared-prefix":
        words += config.system_prompt_len + 1  # "tenant-k:" is one more word
    return rate.max_prompt_tokens(words) + config.output_len_range[1]


def _scaled(config: WorkloadConfig, factor: float) -> WorkloadConfig:
    def length(value: int) -> int:
        return max(1, math.floor(value * factor))

    return dataclasses.replace(
        config,
        input_len_range=(length(config.input_len_range[0]), length(config.input_len_range[1])),
        output_len_range=(length(config.output_len_range[0]), length(config.output_len_range[1])),
        system_prompt_len=length(config.system_prompt_len),
    )


def fit_workload(config: WorkloadConfig, rate: TokenRate, max_model_len: int) -> ContextFit:
    """``config`` itself when its longest request fits ``max_model_len``, else every length scaled by the
    largest factor that fits; :class:`EndpointError` when not even one-word prompts would fit."""
    if longest_request_tokens(config, rate) <= max_model_len:
        return ContextFit(max_model_len, rate, 1.0, config)
    if longest_request_tokens(_scaled(config, 0.0), rate) > max_model_len:
        raise EndpointError(
            f"the served model's context (max_model_len {max_model_len}) cannot hold even a one-word "
            f"prompt of this workload with max_tokens 1 ({rate.per_word:.2f} tokens a word)"
        )
    fits, too_long = 0.0, 1.0
    for _ in range(40):  # the scaled lengths only grow with the factor, so bisection finds the largest
        middle = (fits + too_long) / 2
        if longest_request_tokens(_scaled(config, middle), rate) <= max_model_len:
            fits = middle
        else:
            too_long = middle
    return ContextFit(max_model_len, rate, fits, _scaled(config, fits))


async def measure_token_rate(client: OpenAIStreamClient) -> TokenRate:
    """Tokens a word-list word costs on this endpoint (see the module docstring); :data:`ASSUMED_RATE`
    when the server reports no usage."""
    chunks = [
        " ".join(part) for part in np.array_split(np.array(WORDS), math.ceil(len(WORDS) / PROBE_CHUNK_WORDS))
    ]
    counts: list[int] = []
    for text in [*chunks, chunks[0] + " " + chunks[0]]:
        spec = RequestSpec(index=len(counts), prompt=text, max_tokens=1, prompt_words=len(text.split()))
        try:
            count = await client.count_prompt_tokens(spec)
        except ProbeError as exc:
            raise EndpointError(
                f"a {spec.prompt_words}-word prompt-length probe (max_tokens 1, unstreamed) failed: {exc} "
                "(--no-context-fit skips the probes)"
            ) from None
        if count is None:
            return ASSUMED_RATE
        counts.append(count)
    *chunk_tokens, doubled = counts
    overhead = max(0.0, 2 * chunk_tokens[0] - doubled)  # doubled = overhead + 2 x the first chunk's words
    per_word = (sum(chunk_tokens) - len(chunks) * overhead) / len(WORDS)
    return TokenRate(per_word=max(per_word, 1e-3), overhead=overhead, measured=True)


async def fit_to_context(
    client: OpenAIStreamClient, config: WorkloadConfig, served: ServedModel
) -> ContextFit | None:
    """The workload fitted to ``served``'s context; None when the server reports no context, the
    workload is ShareGPT's or fitting is switched off."""
    if served.max_model_len is None or config.kind == "sharegpt" or not config.fit_context:
        return None
    return fit_workload(config, await measure_token_rate(client), served.max_model_len)


def describe_fit(fit: ContextFit, given: WorkloadConfig) -> str:
    """One line for the report: the context, the measured rate and what (if anything) was resized."""
    rate = fit.rate
    how = (
        f"measured {rate.per_word:.2f} prompt tokens a word (+{rate.overhead:g} a prompt)"
        if rate.measured
        else "the server reports no usage, so one token a word is assumed"
    )
    head = f"max_model_len {fit.max_model_len}; {how}"
    if fit.scale == 1.0:
        return f"{head}; the workload fits as given"

    def lengths(config: WorkloadConfig) -> str:
        text = f"--input-len {_range(config.input_len_range)} --output-len {_range(config.output_len_range)}"
        return text + (
            f" --system-prompt-len {config.system_prompt_len}" if config.kind == "shared-prefix" else ""
        )

    return (
        f"{head}; {lengths(given)} can reach {longest_request_tokens(given, rate)} tokens, so every length "
        f"is scaled by {fit.scale:.3f} to {lengths(fit.workload)} (--no-context-fit sends them as given)"
    )


def _range(bounds: tuple[int, int]) -> str:
    return f"{bounds[0]}:{bounds[1]}"
