"""The engine's delta outputs (``output_kind="delta"``: each holds only what is new) → the chunks a client
is sent (on the engine thread; a buffered chunk holds only new tokens, never a copy of the whole output).

A sample's new tokens ride with the text they produce: tokens whose text is still held back (a possible
stop string, an incomplete UTF-8 character) wait for the next chunk that carries text, or for the
sample's end. So every chunk the handler takes is one *emit* of the tokens it carries (the latency
definitions' t_emit), and a chunk without text is only ever a sample's final one (or any chunk when the
request asked for token ids without text, ``detokenize=False``).

``max_json_bytes`` bounds what a chunk becomes on the wire, for the stream's byte budget: per sample one
SSE event, its envelope (id, model — a served name up to 256 characters —, choice keys, usage) and its
strings at JSON's worst case, 6 bytes a character (``\\u00XX``; UTF-8 needs at most 4).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.outputs import Logprob, RequestOutput


@dataclass(frozen=True)
class SampleDelta:
    index: int
    text: str
    token_ids: tuple[int, ...]
    #: per new token: {token id: Logprob} (top-N and the sampled token), when logprobs were requested
    logprobs: tuple[dict[int, Logprob], ...] | None
    #: set on the sample's last delta
    finish_reason: str | None = None
    stop_reason: str | int | None = None


@dataclass(frozen=True)
class OutputChunk:
    samples: tuple[SampleDelta, ...]
    #: the whole request is done (every sample has sent its finish reason)
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    #: the prompt's logprobs (``prompt_logprobs``), on the first chunk only
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


#: one event's envelope, a token id (``,4294967295``), a logprob entry's keys and numbers in either shape
EVENT_BYTES, TOKEN_ID_BYTES, LOGPROB_BYTES = 768, 12, 96
#: a logprob entry's token text, JSON-escaped (6) and as chat's ``bytes`` list (4 per UTF-8 byte, <= 4 each)
LOGPROB_CHAR_BYTES = 6 + 16


def _logprob_bytes(entry: dict[int, Logprob] | None) -> int:
    if entry is None:
        return TOKEN_ID_BYTES
    return sum(LOGPROB_BYTES + LOGPROB_CHAR_BYTES * len(lp.decoded_token or "") for lp in entry.values())


def max_json_bytes(chunk: OutputChunk) -> int:
    """An upper bound of the bytes the handler writes for ``chunk`` (see the module docstring)."""
    total = 0
    for d in chunk.samples:
        total += EVENT_BYTES + 6 * len(d.text) + TOKEN_ID_BYTES * len(d.token_ids)
        if d.logprobs is not None:
            total += sum(_logprob_bytes(entry) for entry in d.logprobs)
        if chunk.prompt_logprobs is not None:  # repeated on every sample's event
            total += sum(_logprob_bytes(entry) for entry in chunk.prompt_logprobs)
    return total or EVENT_BYTES


class DeltaTracker:
    """Chunks from the engine's delta outputs (``output_kind="delta"``): a sample's new tokens and their
    logprobs wait here while their text is held back; one per request, used by the engine thread only."""

    def __init__(self, detokenize: bool) -> None:
        self._detokenize = detokenize
        #: per sample index: tokens (and logprobs) received whose text has not come out yet
        self._held: dict[int, tuple[list[int], list[dict[int, Logprob]]]] = {}
        self._prompt_logprobs_sent = False

    def update(self, out: RequestOutput) -> OutputChunk | None:
        """The chunk to send for this output, or None when nothing is ready to show."""
        samples = []
        for c in out.outputs:
            tokens, logprobs = self._held.setdefault(c.index, ([], []))
            tokens.extend(c.token_ids)
            if c.logprobs is not None:
                logprobs.extend(c.logprobs)
            finished = c.finish_reason is not None
            if not (c.text or finished or (tokens and not self._detokenize)):
                continue
            del self._held[c.index]
            samples.append(
                SampleDelta(
                    c.index,
                    c.text,
                    tuple(tokens),
                    tuple(logprobs) if c.logprobs is not None else None,
                    c.finish_reason,
                    c.stop_reason,
                )
            )
        if not samples and not out.finished:
            return None
        prompt_logprobs = None
        if out.prompt_logprobs is not None and not self._prompt_logprobs_sent and (samples or out.finished):
            prompt_logprobs, self._prompt_logprobs_sent = out.prompt_logprobs, True
        return OutputChunk(
            tuple(samples), out.finished, len(out.prompt_token_ids), out.num_cached_tokens, prompt_logprobs
        )
