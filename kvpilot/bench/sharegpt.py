"""Reading a ShareGPT-style conversation file into (prompt, reference answer) pairs.

The usual format is a JSON list of objects with ``"conversations": [{"from": "human", "value": ...},
{"from": "gpt", "value": ...}, ...]``. Only the first human turn and the answer right after it are used;
entries without such a pair, or with an empty prompt, are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

_PROMPT_ROLES = frozenset({"human", "user"})
_ANSWER_ROLES = frozenset({"gpt", "assistant", "chatgpt"})


class DatasetError(ValueError):
    """The dataset file cannot be used; the message says why."""


@dataclass(frozen=True)
class ConversationTurnPair:
    prompt: str  # the first human turn
    answer_words: int  # words in the gpt turn that answered it: the output length the dataset implies


def load_sharegpt(path: Path) -> list[ConversationTurnPair]:
    """All usable (prompt, answer length) pairs of the file, in file order."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected a JSON list of conversations, got {type(data).__name__}")

    pairs = []
    for entry in data:
        pair = _first_pair(entry)
        if pair is not None:
            pairs.append(pair)
    if not pairs:
        raise DatasetError(
            f"{path}: no entry has a 'conversations' list starting with a human turn followed by a gpt turn"
        )
    return pairs


def _first_pair(entry: object) -> ConversationTurnPair | None:
    if not isinstance(entry, dict):
        return None
    turns = entry.get("conversations")
    if not isinstance(turns, list) or len(turns) < 2:
        return None
    first, second = turns[0], turns[1]
    if not (isinstance(first, dict) and isinstance(second, dict)):
        return None
    if first.get("from") not in _PROMPT_ROLES or second.get("from") not in _ANSWER_ROLES:
        return None
    prompt, answer = first.get("value"), second.get("value")
    if not isinstance(prompt, str) or not isinstance(answer, str) or not prompt.strip():
        return None
    return ConversationTurnPair(prompt=prompt, answer_words=len(answer.split()))
