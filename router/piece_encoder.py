"""Exact, cached encoding of ASCII text for GPT-2-style byte-level BPE tokenizers (SmolLM2, GPT-2, StarCoder).

Why: HF ``tokenizers`` spends most of an encode in its pre-tokenizer (about 2-3 µs per token on a busy core,
half a millisecond for a 100-word user turn: a quarter of the router's 2 ms budget), while the words
themselves repeat across requests.

Why it is exact: ``Tokenizer.encode`` normalizes, pre-tokenizes and then runs the BPE model on each
pre-token independently. For the pre-tokenizers recognised here (``ByteLevel(use_regex=True,
add_prefix_space=False)``, optionally after ``Digits(individual_digits=True)``, no normalizer) the split of
ASCII text is the GPT-2 regex with ``\\p{L}`` = ``[A-Za-z]``, ``\\p{N}`` = ``[0-9]`` and ``\\s`` = ASCII
whitespace, which Python's ``re`` evaluates the same way (leftmost alternative, same backtracking). Each
pre-token's ids come from the tokenizer's own pre-tokenizer and model the first time the pre-token is seen
(checked to be a single pre-token there), and from a dict afterwards. Non-ASCII text is left to the
tokenizer (``encode`` returns None). ``tests/router/test_piece_encoder.py`` holds both paths equal.

Words instead of the regex, where that is exact: the regex split itself costs ~50-70 ns per character here,
``str.split(" ")`` a tenth of that. Cut text at single spaces into words w0, w1, …; every space that is
followed by a non-whitespace character starts a piece (`` ?[A-Za-z]+``, `` ?[0-9]+`` or
`` ?[^\\s…]+``): a whitespace run ``R`` before it ends one character early under ``\\s+(?!\\S)``, giving ``R``
as it does at the end of a text, and no other piece reaches over a space. So the ids of the text are the ids
of w0 followed by those of " " + wi, each encodable alone, provided every wi (i ≥ 1) is non-empty and starts
with non-whitespace, and — with digits split first — no wi starting with a digit follows a word ending in
whitespace (there the space would end a digit-free part, where ``\\s+(?!\\S)`` keeps it on the run).
" " + wi's ids are cached by wi for words with non-whitespace at both ends (each such word satisfies its side
of both conditions, so only a word seen for the first time is checked); any other text takes the regex path.
"""

from __future__ import annotations

import re
from array import array
from itertools import islice
from typing import Any

from kvpilot.router.generations import Generations

# The GPT-2 pre-tokenizer regex, restricted to ASCII (see the module docstring).
_GPT2_ASCII = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+", re.ASCII
)
# Digits(individual_digits=True): every digit is a piece of its own, cut before the regex runs.
_DIGIT = re.compile(r"([0-9])")
# What the regex's ``\s`` matches in ASCII (not str.isspace, which also takes \x1c-\x1f).
_WHITESPACE = frozenset(" \t\n\r\x0b\x0c")
# Cached ids are packed ``array("I")`` bytes: a prompt's ids are one ``bytes.join`` of its words' entries, and
# no per-token int object is touched (on a core whose caches an engine just evicted, each is a memory miss:
# a never-seen 600-word prompt encoded in 0.38 instead of 0.81 ms, with the pinned vocabulary of Generations).
assert array("I").itemsize == 4


class PieceEncoder:
    def __init__(self, backend: Any, split_digits: bool, max_pieces: int = 1 << 17) -> None:
        """``backend``: the ``tokenizers.Tokenizer`` whose pre-tokenizer and model give each piece's ids."""
        self._backend = backend
        self._split_digits = split_digits
        #: piece → its ids (packed, as every cached value here)
        self._cache: Generations[str, bytes] = Generations(max_pieces)
        #: word w → ids of " " + w, for words with non-whitespace at both ends (see the module docstring)
        self._words: Generations[str, bytes] = Generations(max_pieces)
        #: a text's first word → its ids (the text's start, or the whole text when it has no space)
        self._heads: Generations[str, bytes] = Generations(max_pieces)

    @classmethod
    def for_spec(cls, backend: Any, spec: dict[str, Any]) -> PieceEncoder | None:
        """A :class:`PieceEncoder` if ``spec`` (the parsed ``tokenizer.json``) is a tokenizer it encodes
        exactly, else None."""
        if spec.get("normalizer") is not None or (spec.get("model") or {}).get("type") != "BPE":
            return None
        if (spec.get("model") or {}).get("dropout"):
            return None
        pre = spec.get("pre_tokenizer") or {}
        steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else [pre]
        if not isinstance(steps, list) or not steps:
            return None
        split_digits = False
        if len(steps) == 2 and steps[0] == {"type": "Digits", "individual_digits": True}:
            split_digits, steps = True, steps[1:]
        if len(steps) != 1 or not _is_gpt2_byte_level(steps[0]):
            return None
        return cls(backend, split_digits)

    def warm_from_vocabulary(self) -> int:
        """Pin every vocabulary entry that is an ASCII piece on its own (``" hello"``), each tokenized through
        the tokenizer as on a miss, so a never-seen prompt made of common words costs lookups instead of
        tokenizer calls. Returns how many pieces were pinned."""
        decode = _byte_level_decoder()
        added = 0
        for token in self._backend.get_vocab(with_added_tokens=False):
            raw = (
                bytes(decode.get(char, 0x100) for char in token) if all(c in decode for c in token) else None
            )
            if raw is None or not raw.isascii():
                continue
            piece = raw.decode("ascii")
            if self._split_digits and any(c.isdigit() for c in piece) and len(piece) > 1:
                continue  # digits stand alone there
            if _GPT2_ASCII.findall(piece) != [piece] or piece in self._cache.pinned:
                continue
            piece_ids = self._tokenize(piece)
            if piece_ids is not None:
                self._cache.pin(piece, piece_ids)
                if piece[0] == " " and len(piece) > 1 and piece[-1] not in _WHITESPACE:
                    self._words.pin(piece[1:], piece_ids)  # " word" is one piece: its word's ids
                added += 1
        return added

    @property
    def cached_pieces(self) -> int:
        """Pieces cached from text encoded so far (pinned vocabulary pieces count once used)."""
        return len(self._cache)

    @property
    def pinned_pieces(self) -> int:
        return len(self._cache.pinned)

    def encode(self, text: str) -> array | None:
        """``backend.encode(text, add_special_tokens=False).ids`` as an ``array("I")``, for text without added
        tokens; None when ``text`` is not ASCII (or, defensively, when a piece does not pre-tokenize as one
        piece)."""
        if not text.isascii():
            return None
        words = text.split(" ")
        head = self._heads.young.get(words[0])
        if head is None:
            head = self._encode_head(words[0])
            if head is None:
                return None
        if len(words) == 1:
            return array("I", head)
        if self._split_digits and words[0][-1:] in _WHITESPACE and words[1][:1].isdigit():
            return self._encode_pieces(text)
        # The common case, every word seen recently, in C loops.
        found = list(map(self._words.young.get, islice(words, 1, None)))
        if None in found and not self._fill_misses(words, found):
            return self._encode_pieces(text)
        ids = array("I", head)
        ids.frombytes(b"".join(found))
        return ids

    def _encode_head(self, head: str) -> bytes | None:
        """Ids of a text's first word (the regex path, then cached: a stretch of a chat prompt starts with the
        role and its content's first word, ``"user\\nWhat"``, which would otherwise take the regex path on every
        request)."""
        found = self._encode_pieces(head)
        if found is None:
            return None
        head_ids = found.tobytes()
        self._heads.put(head, head_ids)
        return head_ids

    def _fill_misses(self, words: list[str], found: list[bytes | None]) -> bool:
        """Fill ``found[i]`` (the ids of " " + ``words[i + 1]``) where the young generation had none; False
        when a word's boundaries are not piece boundaries there (the text then takes the regex path)."""
        # Jump from miss to miss with list.index (a C scan): a text with a few new words among hundreds of
        # known ones, a new tenant's system prompt, loops over the new ones only.
        lookup, index = self._words.get, found.index(None)
        while True:
            word_ids = lookup(words[index + 1]) or self._encode_word(words, index + 1)
            if word_ids is None:
                return False
            found[index] = word_ids
            try:
                index = found.index(None, index + 1)
            except ValueError:
                return True

    def _encode_word(self, words: list[str], index: int) -> bytes | None:
        """Ids of " " + ``words[index]`` on their own; None where the words' boundaries are not piece
        boundaries (see the module docstring) or a piece is refused."""
        word = words[index]
        if not word or word[0] in _WHITESPACE:
            return None
        ends_in_whitespace = word[-1] in _WHITESPACE
        if (
            self._split_digits
            and ends_in_whitespace
            and words[index + 1 : index + 2]
            and words[index + 1][:1].isdigit()
        ):
            return None
        found = self._encode_pieces(" " + word)
        if found is None:
            return None
        word_ids = found.tobytes()
        if not ends_in_whitespace:
            self._words.put(word, word_ids)
        return word_ids

    def _encode_pieces(self, text: str) -> array | None:
        """The regex path: every piece of ``text`` through the piece cache."""
        ids = array("I")
        if not self._split_digits:
            return ids if self._extend(ids, _GPT2_ASCII.findall(text)) else None
        # re.split with a capturing group alternates: text between digits, a digit, text, ...
        for position, part in enumerate(_DIGIT.split(text)):
            if position % 2:
                if not self._extend(ids, (part,)):
                    return None
            elif part and not self._extend(ids, _GPT2_ASCII.findall(part)):
                return None
        return ids

    def _extend(self, ids: array, pieces: Any) -> bool:
        young, cache = self._cache.young, self._cache
        for piece in pieces:
            piece_ids = young.get(piece)
            if piece_ids is None:
                piece_ids = cache.get(piece)
                if piece_ids is None:
                    piece_ids = self._tokenize(piece)
                    if piece_ids is None:
                        return False
                    cache.put(piece, piece_ids)
            ids.frombytes(piece_ids)
        return True

    def _tokenize(self, piece: str) -> bytes | None:
        pre_tokens = self._backend.pre_tokenizer.pre_tokenize_str(piece)
        if len(pre_tokens) != 1 or pre_tokens[0][1] != (0, len(piece)):
            return None  # this piece is not one of the tokenizer's pre-tokens: let it encode the text
        return array("I", [token.id for token in self._backend.model.tokenize(pre_tokens[0][0])]).tobytes()


def _byte_level_decoder() -> dict[str, int]:
    """ByteLevel's printable stand-in character → byte (GPT-2's ``bytes_to_unicode``, inverted): printable
    Latin-1 bytes stand for themselves, the others map to 256, 257, … in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    decoder = {chr(b): b for b in printable}
    extra = 0
    for byte in range(256):
        if byte not in decoder.values():
            decoder[chr(256 + extra)] = byte
            extra += 1
    return decoder


def _is_gpt2_byte_level(step: Any) -> bool:
    return (
        isinstance(step, dict)
        and step.get("type") == "ByteLevel"
        and step.get("use_regex", True) is True
        and not step.get("add_prefix_space", False)
    )
