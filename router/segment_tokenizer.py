"""``Tokenizer.encode(text, add_special_tokens=False)`` for rendered chat prompts, with a segment cache.

Why: a long shared system prompt would otherwise be re-tokenized on every request (about 2 µs per token on
a busy core: milliseconds per request, the router's whole overhead budget), and even the template's tiny
recurring stretches (``"\n"``, ``"assistant\n"``) cost tens of µs per encode call.

Why it is exact: HF ``tokenizers`` first cuts the text at its added tokens (``<|im_start|>``, …; leftmost
longest match), and only then normalizes, pre-tokenizes and runs the model on each stretch between them,
independently. Cutting at the same places and encoding each stretch with the shared :class:`Tokenizer`
therefore yields the same ids, and a stretch seen before (the system prompt) comes from the cache. This
holds when added tokens match plainly; a tokenizer whose added tokens strip neighbouring whitespace, match
single words only, or match after a normalizer is encoded whole, uncached.
"""

from __future__ import annotations

import json
import re
from array import array
from collections import OrderedDict
from pathlib import Path

from kvpilot.engine.tokenizer import Tokenizer


class SegmentTokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_dir: str | Path,
        max_cached_tokens: int = 1 << 20,
        max_cached_stretches: int = 1 << 16,
    ) -> None:
        self.tokenizer = tokenizer
        self._max_cached_tokens = max_cached_tokens
        self._max_cached_stretches = max_cached_stretches
        self._cache: OrderedDict[str, array] = OrderedDict()
        self._cached_tokens = 0
        spec = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
        added, plain = _added_tokens(spec)
        self._added_ids = added
        self._splitter: re.Pattern[str] | None = None
        if plain and added:
            # Longest first: at one position, the regex takes the first alternative that matches.
            alternatives = sorted(added, key=len, reverse=True)
            self._splitter = re.compile("(" + "|".join(re.escape(token) for token in alternatives) + ")")

    @property
    def cache_size(self) -> tuple[int, int]:
        """(stretches, tokens) held in the cache."""
        return len(self._cache), self._cached_tokens

    @property
    def segmenting(self) -> bool:
        """Whether encodes go through the segment cache (False: the tokenizer's added tokens forbid it)."""
        return self._splitter is not None

    def encode_rendered(self, text: str) -> array:
        """Ids of a rendered chat prompt, as ``tokenizer.encode(text, add_special_tokens=False)``, in an
        ``array("I")``: cached stretches join by memory copy, and block hashing takes its bytes as they
        are."""
        if self._splitter is None:
            return array("I", self.tokenizer.encode(text, add_special_tokens=False))
        ids = array("I")
        # re.split with a capturing group alternates: stretch, added token, stretch, …
        for position, piece in enumerate(self._splitter.split(text)):
            if position % 2:
                ids.append(self._added_ids[piece])
            elif piece:
                ids.extend(self._encode_stretch(piece))
        return ids

    def _encode_stretch(self, stretch: str) -> array:
        cached = self._cache.get(stretch)
        if cached is not None:
            self._cache.move_to_end(stretch)
            return cached
        ids = array("I", self.tokenizer.encode(stretch, add_special_tokens=False))
        if len(ids) <= self._max_cached_tokens // 4:  # one huge prompt must not flush everything else
            self._cache[stretch] = ids
            self._cached_tokens += len(ids)
            while (
                self._cached_tokens > self._max_cached_tokens or len(self._cache) > self._max_cached_stretches
            ):
                _, evicted = self._cache.popitem(last=False)
                self._cached_tokens -= len(evicted)
        return ids


def _added_tokens(spec: dict) -> tuple[dict[str, int], bool]:
    """The added tokens' contents → ids, and whether they all match plainly (see the module docstring)."""
    normalizer = spec.get("normalizer")
    added: dict[str, int] = {}
    plain = True
    for token in spec.get("added_tokens", []):
        added[token["content"]] = int(token["id"])
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            plain = False
        if token.get("normalized") and normalizer is not None:
            plain = False
    return added, plain
