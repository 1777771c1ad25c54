"""Prompt-lookup proposals: the next ``k`` tokens after the most recent earlier occurrence of the sequence's
last ``n`` tokens, trying ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``.

Text that quotes or edits a passage of its prompt repeats long runs of it, so a match there predicts the
continuation without a draft model. The search runs as ``bytes.rfind`` over the ids' uint32 encoding (a C
loop, no per-token Python); a hit at an offset that is not a multiple of 4 straddles two ids and is
skipped.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NgramConfig:
    """vLLM's ``speculative_config`` fields of method ``ngram``."""

    #: tokens proposed per step
    num_speculative_tokens: int
    #: shortest trailing n-gram that may match
    prompt_lookup_min: int = 1
    #: longest trailing n-gram tried first
    prompt_lookup_max: int = 4

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )


def propose(token_ids: Sequence[int], config: NgramConfig, limit: int | None = None) -> list[int]:
    """Up to ``min(num_speculative_tokens, limit)`` proposed ids for the sequence ``token_ids`` (prompt
    and output so far); empty when no trailing n-gram occurs earlier."""
    k = config.num_speculative_tokens if limit is None else min(config.num_speculative_tokens, limit)
    length = len(token_ids)
    if k <= 0 or length < 2:
        return []
    data = array("I", token_ids).tobytes()
    for n in range(min(config.prompt_lookup_max, length - 1), config.prompt_lookup_min - 1, -1):
        pattern = data[-4 * n :]
        end = len(data) - 4  # a match must end before the sequence's last token (it is the pattern)
        while True:
            found = data.rfind(pattern, 0, end)
            if found < 0:
                break
            if found % 4 == 0:
                start = found // 4 + n
                return list(token_ids[start : start + k])
            end = found + 4 * n - 1  # an unaligned hit: look further left
    return []


def reference_propose(token_ids: Sequence[int], config: NgramConfig, limit: int | None = None) -> list[int]:
    """The plain definition, a Python scan (tests hold :func:`propose` equal to it)."""
    k = config.num_speculative_tokens if limit is None else min(config.num_speculative_tokens, limit)
    ids = list(token_ids)
    if k <= 0:
        return []
    for n in range(min(config.prompt_lookup_max, len(ids) - 1), config.prompt_lookup_min - 1, -1):
        tail = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == tail:
                return ids[start + n : start + n + k]
    return []
