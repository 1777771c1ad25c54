"""A user request's first sequence: the prompt tokenized (when given as text), the prompt and parameters
checked against the loaded model, bad words tokenized and the structured-outputs grammar compiled
(docs/architecture.md#admission). ``LLMEngine.add_request`` registers and schedules what it returns."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.request_validation import (
    RequestError,
    bad_word_token_ids,
    validate_params,
    validate_prompt,
)
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sequence import Sequence
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.structured.grammar import GrammarError
from kvpilot.engine.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestIntake:
    config: EngineConfig
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    #: the model's and the tokenizer's end-of-sequence ids
    eos_token_ids: frozenset[int]
    #: compiles grammars on its own threads (a request the server checked is compiled already)
    grammars: GrammarCompiler

    def first_sequence(
        self,
        request_id: str,
        prompt: str | abc.Sequence[int],
        params: SamplingParams,
        *,
        arrival_time: float | None,
        priority: int,
        cache_salt: str | None,
        deadline: float | None,
    ) -> tuple[Sequence, str | None]:
        """The request's sequence and its prompt text (None when given as token ids). Raises
        ``RequestError`` for bad input."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        sc = self.config.scheduler
        validate_prompt(
            token_ids,
            self.vocab_size,
            self.max_model_len,
            sc.max_num_batched_tokens,
            sc.enable_chunked_prefill,
        )
        validate_params(params, self.vocab_size, self.config.max_logprobs, sc.max_num_seqs)
        seq = Sequence(
            request_id,
            token_ids,
            params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            prompt=text,
            deadline=deadline,
            eos_token_ids=self.eos_token_ids,
        )
        seq.bad_word_ids = bad_word_token_ids(self.tokenizer, params.bad_words)
        if params.structured_outputs is not None:
            try:
                seq.grammar = self.grammars.matcher(params.structured_outputs)
            except GrammarError as err:
                raise RequestError(f"structured_outputs: {err}") from None
        return seq, text
