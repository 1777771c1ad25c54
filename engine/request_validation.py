"""Checks a request against the loaded model before it is admitted; every failure is a ``RequestError``
whose message names the offending field (the server turns it into an HTTP 400)."""

from __future__ import annotations

from collections.abc import Iterable

from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.tokenizer import Tokenizer


class RequestError(ValueError):
    """A request cannot be served as given (e.g. prompt longer than the context); message says why,
    ``param`` names the request's field (the 400's ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def validate_prompt(
    token_ids: list[int], vocab: int, max_model_len: int, max_num_batched_tokens: int, chunked_prefill: bool
) -> None:
    if not token_ids:
        raise RequestError("the prompt is empty", "prompt")
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}", "prompt")
    if len(token_ids) >= max_model_len:
        raise RequestError(
            f"prompt has {len(token_ids)} tokens; the context limit is {max_model_len} "
            "(prompt + at least one generated token)",
            "prompt",
        )
    if not chunked_prefill and len(token_ids) > max_num_batched_tokens:
        raise RequestError(
            f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
            f"({max_num_batched_tokens}) with chunked prefill disabled",
            "prompt",
        )


def validate_params(
    p: SamplingParams, vocab: int, max_logprobs: int, max_num_seqs: int | None = None
) -> None:
    def ids_in_vocab(name: str, ids: Iterable[int]) -> None:
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"{name} has token ids outside the vocabulary [0, {vocab}): {bad[:5]}", name)

    ids_in_vocab("logit_bias", p.logit_bias)
    ids_in_vocab("stop_token_ids", p.stop_token_ids)
    if p.allowed_token_ids is not None:
        ids_in_vocab("allowed_token_ids", p.allowed_token_ids)
    for name, value in (("logprobs", p.logprobs), ("prompt_logprobs", p.prompt_logprobs)):
        if value is not None and value > max_logprobs:
            raise RequestError(f"{name}={value} exceeds the server's max_logprobs ({max_logprobs})", name)
    if max_num_seqs is not None and p.num_samples > max_num_seqs:
        # every sample (or beam) is a sequence of the batch: more than the batch holds could never run
        what = "beam width" if p.use_beam_search else ("best_of" if p.best_of is not None else "n")
        raise RequestError(
            f"{what}={p.num_samples} exceeds the server's max_num_seqs ({max_num_seqs}): "
            "its samples run as parallel sequences of one batch",
            "best_of" if p.best_of is not None else "n",
        )


def bad_word_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    """Token sequences to ban for each bad word: as written and with a leading space (how a word appears
    mid-sentence for byte-level BPE), without duplicates."""
    out: list[list[int]] = []
    for word in words:
        for variant in (word, " " + word.lstrip()):
            ids = tokenizer.encode(variant, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out
