"""What the router needs to know about one OpenAI request to score replicas: tenant, prompt token ids (exactly
as the engine derives them, through the shared ``kvpilot.engine`` functions), output budget, block hashes.

A request the router cannot derive a prompt from (a malformed body, a chat template that refuses the
messages, text the tokenizer cannot take such as a lone surrogate, nesting too deep to render) is not
rejected here: it is routed without locality and the engine gives the authoritative error.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from kvpilot.engine.kv.block_hash import encode_extra_keys, hash_block
from kvpilot.engine.prompt_bound import max_chars_per_token, min_tokens
from kvpilot.engine.prompt_render import completion_prompt_ids, render_chat_prompt
from kvpilot.engine.tokenizer import Tokenizer
from kvpilot.router.block_chain import BlockChain
from kvpilot.router.segment_tokenizer import SegmentTokenizer

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
# Parent of the tie-break key: a constant, so the key does not depend on which replica's root is known.
_TIE_ROOT = b"kvpilot-router-tie-v1"
_TOKEN_ID_LIMIT = 1 << 32  # block hashes hold ids as uint32; the engine refuses larger ones anyway
_MAX_OUTPUT_BUDGET = 1 << 53  # beyond any KV cache, and still exact as the float the scoring divides
#: a request's prompts the router tokenizes and hashes at most (each costs a tokenizer call on the event loop)
MAX_PROFILED_PROMPTS = 128
#: characters the router tokenizes for one request at most (~0.5 s of one core), whatever the context limit
MAX_PROFILED_CHARS = 1 << 20
# What rendering and tokenizing arbitrary client JSON can raise: all of it is the request's fault.
_BAD_INPUT = (ValueError, TypeError, LookupError, RecursionError, ArithmeticError)


class PromptError(ValueError):
    """The router cannot derive the prompt's token ids from this request body."""


@dataclass
class RequestProfile:
    tenant: str | None
    #: token ids of each prompt (a completions request may carry several; a chat prompt's is an array("I"))
    prompts: tuple[Sequence[int], ...]
    #: output tokens the request may generate (max_tokens × n), for the KV headroom check
    max_output_tokens: int
    #: encoded extra keys (the tenant's cache salt) of every block hash
    extra: bytes
    _chains: dict[tuple[bytes, int], list[BlockChain]] = field(default_factory=dict, repr=False)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)

    def chains(self, root: bytes, block_size: int) -> list[BlockChain]:
        """Each prompt's block chain under one replica's root and block size (shared by replicas alike)."""
        key = (root, block_size)
        chains = self._chains.get(key)
        if chains is None:
            chains = self._chains[key] = [
                BlockChain(ids, block_size, root, self.extra) for ids in self.prompts
            ]
        return chains

    def tie_key(self, block_size: int) -> bytes:
        """Rendezvous key: the first prompt's first block of tokens and the tenant salt (so two routers, and
        two requests sharing a first block, agree)."""
        first = self.prompts[0][:block_size] if self.prompts else []
        return hash_block(_TIE_ROOT, first, self.extra)


class RequestProfiler:
    def __init__(self, tokenizer: Tokenizer, segments: SegmentTokenizer) -> None:
        self._tokenizer = tokenizer
        self._segments = segments
        #: the most characters one token can stand for (None: no bound for this tokenizer)
        self._chars_per_token = max_chars_per_token(tokenizer)
        #: the fleet's largest context limit in tokens (None: unknown yet); set by the app
        self.context_limit: Callable[[], int | None] = lambda: None

    def _check_length(self, chars: int, prompts: int = 1) -> None:
        """Refuse to tokenize what is more work than one request may cost the router's event loop: texts
        whose length alone proves them longer than every replica's context (the engine's own character
        bound, ``kvpilot.engine.prompt_bound``), or over :data:`MAX_PROFILED_CHARS`, or more than
        :data:`MAX_PROFILED_PROMPTS` prompts. The bound is on all of a request's texts together: such a
        request is routed without locality, and the engine, the authority, answers it (400 for a text
        beyond its context, without tokenizing it either)."""
        if prompts > MAX_PROFILED_PROMPTS:
            raise PromptError(f"{prompts} prompts: the router profiles at most {MAX_PROFILED_PROMPTS}")
        what = f"{chars} characters" if prompts == 1 else f"{prompts} prompts of {chars} characters in all"
        limit = self.context_limit()
        if limit and self._chars_per_token and min_tokens(chars, self._chars_per_token) >= limit:
            raise PromptError(f"{what} cannot fit a {limit}-token context")
        if chars > MAX_PROFILED_CHARS:
            raise PromptError(f"{what}: over the {MAX_PROFILED_CHARS} the router tokenizes for one request")

    def profile(self, path: str, body: dict[str, Any], tenant: str | None) -> RequestProfile:
        """Raises :class:`PromptError` when the body does not give a prompt the router can tokenize."""
        try:
            return self._profile(path, body, tenant)
        except PromptError:
            raise
        except _BAD_INPUT as error:
            raise PromptError(f"{type(error).__name__}: {error}") from None

    def _profile(self, path: str, body: dict[str, Any], tenant: str | None) -> RequestProfile:
        if path == CHAT_COMPLETIONS:
            prompts: tuple[Sequence[int], ...] = (self._chat_ids(body),)
        elif path == COMPLETIONS:
            texts = _completion_prompts(body)
            self._check_length(sum(len(p) for p in texts if isinstance(p, str)), len(texts))
            prompts = tuple(completion_prompt_ids(self._tokenizer, p) for p in texts)
        else:
            raise PromptError(f"no prompt on {path}")
        return RequestProfile(
            tenant=tenant,
            prompts=prompts,
            max_output_tokens=_output_budget(body),
            extra=_salt_keys(tenant),
        )

    def _chat_ids(self, body: dict[str, Any]) -> Sequence[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise PromptError("'messages' must be a non-empty list")
        add_generation_prompt = body.get("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs")
        kwargs = {} if kwargs is None else kwargs
        if not isinstance(kwargs, dict) or not isinstance(add_generation_prompt, bool):
            raise PromptError("'chat_template_kwargs' must be an object, 'add_generation_prompt' a boolean")
        if "tools" in body:
            kwargs = {**kwargs, "tools": body["tools"]}
        # kvpilot.engine.prompt_render.chat_prompt_ids renders and then encodes the whole text; the router
        # renders with the same template and encodes through its segment cache, which gives the same ids
        # (tests/router/test_request_profile.py holds the two paths equal).
        try:
            text = render_chat_prompt(self._tokenizer, messages, add_generation_prompt, **kwargs)
        except ValueError as error:
            raise PromptError(str(error)) from None
        self._check_length(len(text))
        return self._segments.encode_rendered(text)


@functools.lru_cache(maxsize=1 << 12)  # a tenant's requests share it: one hash per tenant, not per request
def _salt_keys(tenant: str | None) -> bytes:
    return encode_extra_keys(cache_salt=tenant)


def _completion_prompts(body: dict[str, Any]) -> list[str | list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(_is_token_id(t) for t in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
            return list(prompt)
    raise PromptError("'prompt' must be a string, a list of token ids, or a list of either")


def _is_token_id(value: Any) -> bool:
    return _is_count(value) and value < _TOKEN_ID_LIMIT


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _output_budget(body: dict[str, Any]) -> int:
    limit = body.get("max_tokens", body.get("max_completion_tokens"))
    samples = body.get("n", 1)
    limit = limit if _is_count(limit) else 0
    samples = samples if _is_count(samples) and samples > 0 else 1
    return min(limit * samples, _MAX_OUTPUT_BUDGET)
