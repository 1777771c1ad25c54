"""``SamplingParams``: per-request generation parameters with vLLM's names, validated on construction.

Which tokens the penalties count: ``repetition_penalty`` applies to every token seen (prompt and output,
as in HF and vLLM); ``frequency_penalty`` and ``presence_penalty`` count generated tokens only (OpenAI
semantics); ``no_repeat_ngram_size`` and ``bad_words`` look at generated tokens only.

``structured_outputs`` (a ``StructuredOutputsParams``: JSON schema, regex, choice, grammar or any JSON
object) constrains the output to a grammar; ``guided_decoding`` is vLLM's older name for it
(docs/architecture.md#structured-outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpilot.engine.structured.params import StructuredOutputsParams

#: what each ``RequestOutput`` of a request holds (vLLM's ``RequestOutputKind``): ``cumulative`` everything so
#: far (each output copies the whole completion: a cost that grows with its length), ``delta`` only what is
#: new since the request's previous output (what the server streams), ``final_only`` one output, at the end
OUTPUT_KINDS = ("cumulative", "delta", "final_only")

#: below this temperature a row is drawn from the T -> 0 limit (uniform over the maximal logits) instead of
#: dividing by T, which would overflow; T = 0 exactly is the greedy branch (lowest id among ties)
NEAR_ZERO_TEMPERATURE = 1e-5
LOGIT_BIAS_LIMIT = 100.0
#: the largest finite float32: the sampler computes in float32, so temperature and repetition_penalty (which
#: vLLM bounds only below) may not exceed it; 1e308 became inf there, and -inf/inf a NaN logit
FLOAT32_MAX = 3.4028234663852886e38
#: the seeds a torch.Generator takes (the server's protocol allows the same); a larger one overflowed in it
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names the parameter."""


@dataclass
class SamplingParams:
    #: samples returned per prompt
    n: int = 1
    #: samples generated (the best ``n`` by cumulative logprob are returned); None = ``n``
    best_of: int | None = None
    #: subtract ``presence_penalty`` from every token generated at least once
    presence_penalty: float = 0.0
    #: subtract ``frequency_penalty × count`` for every generated token
    frequency_penalty: float = 0.0
    #: sign-aware scaling of tokens seen in prompt or output: z/r if z > 0, z·r if z < 0; 1 = off
    repetition_penalty: float = 1.0
    #: 0 = greedy (ties → lowest token id); > 0 scales logits by 1/T
    temperature: float = 1.0
    #: nucleus: the smallest prefix (by probability) whose mass reaches top_p; 1 = off
    top_p: float = 1.0
    #: keep the k highest logits (ties → lower token id); -1 (or 0) = off
    top_k: int = -1
    #: keep tokens with p ≥ min_p · p_max (z ≥ z_max + T·log min_p); 0 = off
    min_p: float = 0.0
    #: locally typical sampling: tokens by |−log p − H| ascending until their mass reaches typical_p; 1 = off
    typical_p: float = 1.0
    #: per-request RNG seed; the same seed gives the same tokens whatever else is batched
    seed: int | None = None
    #: strings that end the request (may span tokens; never emitted partially)
    stop: list[str] = field(default_factory=list)
    #: token ids that end the request like EOS (the token is kept in the output)
    stop_token_ids: list[int] = field(default_factory=list)
    #: words whose token sequences may never be generated (each is banned with and without a leading space)
    bad_words: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    #: keep generating past EOS
    ignore_eos: bool = False
    #: most new tokens to generate (None = up to the context limit)
    max_tokens: int | None = 16
    #: fewest new tokens before EOS / stop tokens may end the request
    min_tokens: int = 0
    #: top-N logprobs per generated token (the sampled token is always included); None = off
    logprobs: int | None = None
    #: top-N logprobs per prompt token; None = off (disables prefix-cache hits for the request)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    #: token id → bias added to its logit, clamped to ±100
    logit_bias: dict[int, float] = field(default_factory=dict)
    #: only these token ids may be generated; None = all
    allowed_token_ids: list[int] | None = None
    #: never repeat a generated n-gram of this size; 0 = off
    no_repeat_ngram_size: int = 0
    #: deterministic beam search over ``beam_width`` beams, returning the best ``n``
    use_beam_search: bool = False
    #: beams kept per step (None = max(n, best_of))
    beam_width: int | None = None
    #: hypothesis score = cumulative logprob / length ** length_penalty
    length_penalty: float = 1.0
    #: produce text (False: token ids only)
    detokenize: bool = True
    #: the grammar the output must follow (None = free text)
    structured_outputs: StructuredOutputsParams | None = None
    #: vLLM's older name for ``structured_outputs`` (either may be given, not both)
    guided_decoding: StructuredOutputsParams | None = None
    #: what each output of the request holds: ``OUTPUT_KINDS`` (``LLM.generate`` asks for ``final_only``)
    output_kind: str = "cumulative"

    def __post_init__(self) -> None:
        stop: object = self.stop  # typed as normalised below; a caller may pass one string (vLLM does)
        if isinstance(stop, str):
            self.stop = [stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.bad_words = list(self.bad_words or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs != self.guided_decoding:
                raise SamplingParamsError("structured_outputs and guided_decoding are one setting: give one")
            self.structured_outputs = self.guided_decoding
        self.guided_decoding = self.structured_outputs
        try:
            self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}
        except (TypeError, ValueError, AttributeError):
            raise SamplingParamsError("logit_bias must map integer token ids to numbers") from None
        self.validate()

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def num_samples(self) -> int:
        """Sequences generated in parallel for this request."""
        if self.use_beam_search:
            return self.effective_beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def effective_beam_width(self) -> int:
        return self.beam_width if self.beam_width is not None else max(self.n, self.best_of or self.n)

    @property
    def clamped_logit_bias(self) -> dict[int, float]:
        return {t: max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for t, b in self.logit_bias.items()}

    @property
    def needs_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_masks(self) -> bool:
        return bool(
            self.allowed_token_ids is not None
            or self.logit_bias
            or self.bad_words
            or self.min_tokens
            or self.no_repeat_ngram_size
        )

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise SamplingParamsError(msg)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        need(is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        need(
            self.output_kind in OUTPUT_KINDS,
            f"output_kind must be one of {', '.join(OUTPUT_KINDS)}, got {self.output_kind!r}",
        )
        need(
            self.best_of is None or (is_int(self.best_of) and self.best_of >= self.n),
            f"best_of must be an integer >= n ({self.n}), got {self.best_of!r}",
        )
        need(
            -2.0 <= self.presence_penalty <= 2.0,
            f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
        )
        need(
            -2.0 <= self.frequency_penalty <= 2.0,
            f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
        )
        need(
            0 < self.repetition_penalty <= FLOAT32_MAX,
            f"repetition_penalty must be > 0 and <= {FLOAT32_MAX:.8g} (float32), "
            f"got {self.repetition_penalty}",
        )
        need(
            0 <= self.temperature <= FLOAT32_MAX,
            f"temperature must be >= 0 and <= {FLOAT32_MAX:.8g} (float32), got {self.temperature}",
        )
        need(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        need(is_int(self.top_k) and self.top_k >= -1, f"top_k must be -1 (off) or >= 0, got {self.top_k!r}")
        need(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        need(0 < self.typical_p <= 1, f"typical_p must be in (0, 1], got {self.typical_p}")
        need(
            self.seed is None or (is_int(self.seed) and SEED_MIN <= self.seed <= SEED_MAX),
            f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        need(
            all(is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}",
        )
        need(
            all(isinstance(w, str) and w.strip() for w in self.bad_words),
            "bad_words must be non-empty strings",
        )
        need(
            self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}",
        )
        need(
            is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        need(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        need(
            self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0),
            f"logprobs must be an integer >= 0 or None, got {self.logprobs!r}",
        )
        need(
            self.prompt_logprobs is None or (is_int(self.prompt_logprobs) and self.prompt_logprobs >= 0),
            f"prompt_logprobs must be an integer >= 0 or None, got {self.prompt_logprobs!r}",
        )
        need(all(k >= 0 for k in self.logit_bias), "logit_bias token ids must be non-negative")
        need(
            self.allowed_token_ids is None
            or (
                len(self.allowed_token_ids) > 0 and all(is_int(t) and t >= 0 for t in self.allowed_token_ids)
            ),
            "allowed_token_ids must be a non-empty list of non-negative token ids",
        )
        need(
            is_int(self.no_repeat_ngram_size) and self.no_repeat_ngram_size >= 0,
            f"no_repeat_ngram_size must be an integer >= 0, got {self.no_repeat_ngram_size!r}",
        )
        need(
            self.beam_width is None or (is_int(self.beam_width) and self.beam_width >= 1),
            f"beam_width must be an integer >= 1, got {self.beam_width!r}",
        )
        need(
            self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs must be a StructuredOutputsParams",
        )
        if self.use_beam_search:
            need(
                self.structured_outputs is None,
                "structured_outputs does not combine with use_beam_search: beams may only take tokens "
                "the grammar allows, which the beam search does not know",
            )
            need(
                self.effective_beam_width >= self.n,
                f"beam_width ({self.effective_beam_width}) must be >= n ({self.n})",
            )
            need(
                self.temperature == 0 or self.temperature == 1.0,
                "beam search is deterministic: leave temperature at its default (or 0)",
            )
            need(
                self.top_p == 1 and self.top_k in (-1, 0) and self.min_p == 0 and self.typical_p == 1,
                "beam search does not combine with top_p/top_k/min_p/typical_p",
            )
            need(
                self.logprobs is None,
                "logprobs are not reported with use_beam_search (each hypothesis gives its "
                "cumulative_logprob); leave logprobs unset",
            )
