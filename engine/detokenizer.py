"""Incremental detokenization and stop-string handling for one generated sequence
(docs/architecture.md#stop-conditions-and-streaming).

``IncrementalDetokenizer`` turns each new token into a text delta without re-decoding the whole output:
it decodes a short window (``prefix_offset`` … end) and emits what extends beyond the window's already
emitted part. A byte-level token that ends inside a multi-byte UTF-8 character decodes to U+FFFD; such a
delta is held back until the character completes, so the stream never contains a replacement character
that the full text does not.

``StopStringBuffer`` holds back any text that could still become a stop string: only text that can no
longer be part of a match is released. When a stop string appears (it may span several tokens), the text
is cut before it (or after it with ``include_stop_str_in_output``) and nothing of it has leaked.
"""

from __future__ import annotations

from kvpilot.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
#: tokens decoded before the first new token, so merges across the boundary resolve like a full decode
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Text newly completed by ``token_id`` (may be empty while a character is incomplete)."""
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith(REPLACEMENT):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.tokens)
            return delta
        return ""

    def flush(self) -> str:
        """At the end: whatever is still undecided (an incomplete character decodes as U+FFFD)."""
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""


class StopStringBuffer:
    """Accumulates text; releases only what cannot become (part of) a stop string."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self.released = ""  # text safe to show
        self.pending = ""  # text that might still start a stop string
        self.matched: str | None = None

    def push(self, delta: str) -> str | None:
        """Add ``delta``; returns the matched stop string when one completes (then ``released`` is final)."""
        if self.matched is not None or not delta:
            return self.matched
        text = self.pending + delta
        if not self.stops:
            self.released += text
            self.pending = ""
            return None
        # earliest complete match across all stop strings (search includes the pending tail)
        best: tuple[int, str] | None = None
        for stop in self.stops:
            pos = text.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            pos, stop = best
            self.released += text[: pos + len(stop)] if self.include_stop else text[:pos]
            self.pending = ""
            self.matched = stop
            return stop
        hold = self._holdback(text)
        self.released += text[: len(text) - hold]
        self.pending = text[len(text) - hold :]
        return None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        """The request ended for another reason: the held-back text is safe after all."""
        if self.matched is None:
            self.released += self.pending
        self.pending = ""
        return self.released
