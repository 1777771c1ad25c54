"""``SamplingParams``: per-request generation parameters with vLLM's names, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

_EPS = 1e-5  # temperatures below this are treated as greedy (T = 0 branch), never divided by


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass
class SamplingParams:
    #: most new tokens to generate (None = up to the context limit)
    max_tokens: int | None = 16
    #: fewest new tokens before EOS / stop tokens may end the request
    min_tokens: int = 0
    #: 0 = greedy (ties → lowest token id); > 0 scales logits by 1/T
    temperature: float = 1.0
    #: nucleus: the smallest prefix (by probability) whose mass reaches top_p; 1 = off
    top_p: float = 1.0
    #: keep the k highest logits (ties → lower token id); -1 (or 0) = off
    top_k: int = -1
    #: per-request RNG seed; the same seed gives the same tokens whatever else is batched
    seed: int | None = None
    #: keep generating past EOS
    ignore_eos: bool = False
    #: token ids that end the request like EOS (the token is kept in the output)
    stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _EPS

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(msg)

        need(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
             f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}")
        need(isinstance(self.min_tokens, int) and self.min_tokens >= 0,
             f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        need(self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        need(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(isinstance(self.top_k, int) and self.top_k >= -1, f"top_k must be -1 (off) or >= 0, got {self.top_k!r}")
        need(self.seed is None or isinstance(self.seed, int), f"seed must be an integer, got {self.seed!r}")
        need(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
