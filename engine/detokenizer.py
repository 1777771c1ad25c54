"""Incremental detokenization and stop-string handling for one generated sequence
(docs/architecture.md#stop-conditions-and-streaming).

``IncrementalDetokenizer`` turns each new token into a text delta without re-decoding the whole output,
through the ``tokenizers`` library's own ``DecodeStream`` (one native call per token, as vLLM's fast
detokenizer does): it decodes a short window of recent tokens and emits what extends beyond the window's
already emitted part. A byte-level token that ends inside a multi-byte UTF-8 character decodes to U+FFFD;
such a delta is held back until the character completes, so the stream never contains a replacement
character that the full text does not. The stream is primed with the prompt's last tokens, so merges
across the boundary resolve as in a full decode.

``StopStringBuffer`` holds back any text that could still become a stop string: only text that can no
longer be part of a match is released. When a stop string appears (it may span several tokens), the text
is cut before it (or after it with ``include_stop_str_in_output``) and nothing of it has leaked.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from kvpilot.engine.tokenizer import Tokenizer

REPLACEMENT = "\ufffd"
#: tokens decoded before the first new token, so merges across the boundary resolve like a full decode
_CONTEXT_TOKENS = 5
#: what ``DecodeStream.step`` raises when a window's decode does not extend the previous one (some
#: tokenizers' decoders strip or merge at the window's start); the stream restarts from recent tokens
_INVALID_PREFIX = "Invalid prefix"


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # A context that ends inside a character (or on a token that decodes to nothing) would leave the
        # stream holding prompt bytes that the first delta then shows: drop such trailing tokens.
        context = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._stream, complete = self._primed(context)
        while context and not complete:
            context.pop()
            self._stream, complete = self._primed(context)
        self.tokens: list[int] = context
        #: tokens whose text has been emitted (or is the prompt's)
        self.read_offset = len(self.tokens)

    def _primed(self, context: list[int]) -> tuple[DecodeStream, bool]:
        """A stream that has seen ``context``, and whether it holds none of it back."""
        stream = DecodeStream(skip_special_tokens=self.skip_special_tokens)
        complete = True
        for token_id in context:
            complete = self._step(stream, token_id) is not None
        return stream, complete

    def _step(self, stream: DecodeStream, token_id: int) -> str | None:
        if token_id >= self.tokenizer.vocab_size:  # a padded embedding row: decodes to nothing, as in HF
            return None
        return stream.step(self.tokenizer.backend, token_id)

    def push(self, token_id: int) -> str:
        """Text newly completed by ``token_id`` (may be empty while a character is incomplete)."""
        self.tokens.append(token_id)
        try:
            chunk = self._step(self._stream, token_id)
        except Exception as error:  # tokenizers raises a bare Exception for this
            if not str(error).startswith(_INVALID_PREFIX):
                raise
            window = self.tokens[max(0, self.read_offset - _CONTEXT_TOKENS) : self.read_offset]
            self._stream = self._primed(window)[0]
            return self._pushed_after_restart()
        if chunk is None:
            return ""
        self.read_offset = len(self.tokens)
        return chunk

    def _pushed_after_restart(self) -> str:
        """The tokens after ``read_offset`` through the restarted stream; their text, if complete."""
        text, start = "", self.read_offset
        for position in range(start, len(self.tokens)):
            chunk = self._step(self._stream, self.tokens[position])
            if chunk is not None:  # everything up to this token is out; a later one may still be held
                text += chunk
                self.read_offset = position + 1
        return text

    def flush(self) -> str:
        """At the end: whatever is still undecided (an incomplete character decodes as U+FFFD)."""
        if self.read_offset == len(self.tokens):
            return ""
        start = max(0, self.read_offset - _CONTEXT_TOKENS)
        prefix = self._decode(self.tokens[start : self.read_offset])
        full = self._decode(self.tokens[start:])
        self.read_offset = len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


class StopStringBuffer:
    """Accumulates text; releases only what cannot become (part of) a stop string.

    Released text is kept as pieces: ``take_released`` hands out what is new since its last call without
    joining the whole text (a delta output's cost does not grow with the completion's length);
    ``released`` joins it all (cumulative outputs)."""

    def __init__(self, stops: list[str], include_stop: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_stop = include_stop
        self._pieces: list[str] = []  # text safe to show
        self._joined = ""  # the first _num_joined pieces, joined
        self._num_joined = 0
        self._num_taken = 0
        self.pending = ""  # text that might still start a stop string
        self.matched: str | None = None

    @property
    def released(self) -> str:
        """All the text safe to show so far."""
        if self._num_joined < len(self._pieces):
            self._joined += "".join(self._pieces[self._num_joined :])
            self._num_joined = len(self._pieces)
        return self._joined

    def take_released(self) -> str:
        """The text released since the previous call."""
        new = "".join(self._pieces[self._num_taken :])
        self._num_taken = len(self._pieces)
        return new

    def _release(self, text: str) -> None:
        if text:
            self._pieces.append(text)

    def push(self, delta: str) -> str | None:
        """Add ``delta``; returns the matched stop string when one completes (then ``released`` is final)."""
        if self.matched is not None or not delta:
            return self.matched
        text = self.pending + delta
        if not self.stops:
            self._release(text)
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
            self._release(text[: pos + len(stop)] if self.include_stop else text[:pos])
            self.pending = ""
            self.matched = stop
            return stop
        hold = self._holdback(text)
        self._release(text[: len(text) - hold])
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
        """The request ended for another reason: the held-back text is safe after all; returns all the
        released text."""
        if self.matched is None:
            self._release(self.pending)
        self.pending = ""
        return self.released
