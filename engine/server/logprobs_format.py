"""Engine logprobs (per token: ``{token id: Logprob}`` holding the top-N and the sampled token) in OpenAI's
two shapes: the legacy completions object and the chat ``content`` list. JSON has no -inf, so a masked
token's logprob is reported as -9999.0 (vLLM's convention)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpilot.engine.outputs import Logprob

FLOOR = -9999.0


def _finite(value: float) -> float:
    return value if value > FLOOR else FLOOR


def _ranked(entry: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    return sorted(entry.items(), key=lambda item: (item[1].rank, item[0]))


def _text(lp: Logprob | None) -> str:
    return lp.decoded_token or "" if lp is not None else ""


def completion_logprobs(
    token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], text_offset: int
) -> tuple[dict, int]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for these tokens, and the offset after
    them. ``top_logprobs`` lists the top-N and the sampled token (up to N + 1 entries, as OpenAI does)."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, entry in zip(token_ids, entries, strict=True):
        sampled = entry.get(token)
        text = _text(sampled)
        out["tokens"].append(text)
        out["token_logprobs"].append(_finite(sampled.logprob) if sampled is not None else None)
        top: dict[str, float] = {}
        for _, lp in _ranked(entry):  # tokens that decode alike share a key: the better-ranked one keeps it
            top.setdefault(_text(lp), _finite(lp.logprob))
        out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(text)
    return out, text_offset


def _chat_entry(lp: Logprob) -> dict:
    text = _text(lp)
    return {"token": text, "logprob": _finite(lp.logprob), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], entries: Sequence[dict[int, Logprob]], top_n: int) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [the top_n by rank]}]}``."""
    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        sampled = entry.get(token) or Logprob(FLOOR, 0, "")
        item = _chat_entry(sampled)
        item["top_logprobs"] = [_chat_entry(lp) for _, lp in _ranked(entry) if lp.rank <= top_n][:top_n]
        content.append(item)
    return {"content": content}


def prompt_logprobs_json(entries: list[dict[int, Logprob] | None]) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token ``{token id: {"logprob", "rank", "decoded_token"}}``."""
    return [
        None
        if entry is None
        else {
            str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in _ranked(entry)
        }
        for entry in entries
    ]
