"""One sequence of a user request (``Sequence``; the request itself is a ``SequenceGroup``) and its lifecycle
state machine (docs/architecture.md#request-state-machine), enforced in one place.

States and the resources each holds:
- QUEUED: admitted with a KV *reservation* (accounting only); no physical blocks yet.
- RUNNABLE: picked by a scheduler tick; physical blocks allocated.
- PREFILL / DECODE: computing the prompt (possibly in chunks) / generating one token per step.
- BACKPRESSURED: the client is not draining its stream; holds blocks but is not scheduled.
- PREEMPTED: blocks freed (recompute); waits in the queue to be recomputed.
- SWAPPED: blocks copied to host memory and freed on the device.
  Either can end FINISHED without coming back: a beam preempted while it waited for its siblings that the
  beam search then prunes or completes.
- FINISHED, CANCELLED, TIMED_OUT, FAILED: terminal; every one goes through one reclaim routine.
An illegal transition is a bug and raises ``IllegalTransition``. Rejecting and degrading a request are
admission decisions the server takes before an engine request exists (an HTTP error; ``best_of`` lowered
to ``n`` and the response marked), so they are no engine states.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvpilot.engine.sampling.params import SamplingParams
    from kvpilot.engine.sequence_group import SequenceGroup
    from kvpilot.engine.structured.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    QUEUED = "queued"
    RUNNABLE = "runnable"
    PREFILL = "prefill"
    DECODE = "decode"
    BACKPRESSURED = "backpressured"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"
    FINISHED = "finished"
    CANCELLED = "cancelled"
    TIMED_OUT = "timed_out"
    FAILED = "failed"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    @property
    def is_waiting(self) -> bool:
        """In the scheduler's waiting queue (no physical blocks on the device)."""
        return self in (SequenceStatus.QUEUED, SequenceStatus.PREEMPTED)


S = SequenceStatus
TERMINAL = frozenset({S.FINISHED, S.CANCELLED, S.TIMED_OUT, S.FAILED})
_ABORTS = {S.CANCELLED, S.TIMED_OUT, S.FAILED}

#: legal transitions; every terminal state is reachable from every live one except as listed
TRANSITIONS: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    S.QUEUED: frozenset({S.RUNNABLE} | _ABORTS),
    S.RUNNABLE: frozenset({S.PREFILL, S.DECODE, S.PREEMPTED, S.SWAPPED} | _ABORTS),
    S.PREFILL: frozenset({S.PREFILL, S.DECODE, S.PREEMPTED, S.SWAPPED, S.FINISHED} | _ABORTS),
    S.DECODE: frozenset({S.DECODE, S.BACKPRESSURED, S.PREEMPTED, S.SWAPPED, S.FINISHED} | _ABORTS),
    # FINISHED: a stop in the last token, found after the scheduler paused it (asynchronous scheduling's
    # token in flight, a deferred stop string)
    S.BACKPRESSURED: frozenset({S.DECODE, S.PREEMPTED, S.SWAPPED, S.FINISHED} | _ABORTS),
    S.PREEMPTED: frozenset({S.RUNNABLE, S.FINISHED} | _ABORTS),
    S.SWAPPED: frozenset({S.RUNNABLE, S.FINISHED} | _ABORTS),
    **{t: frozenset() for t in TERMINAL},
}


class IllegalTransition(RuntimeError):
    pass


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, stop token or stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled
    TIMEOUT = "timeout"
    ERROR = "error"


@dataclass
class RequestTimes:
    """Monotonic timestamps (``time.monotonic``) for the latency definitions
    (docs/architecture.md#latency-definitions)."""

    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    #: emit time of each committed token, for ITL (t_emit,j − t_emit,j−1)
    token_times: list[float] = field(default_factory=list)


class Sequence:
    """One sequence being generated. Parallel samples (``n`` > 1) and beams are sibling sequences of one
    request (its ``group``), sharing KV blocks; ``seq_id`` is the request's id for its first sequence and
    the request's id + ``#i`` / ``#bi`` for the others."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        adapter_id: str | None = None,
        prompt: str | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
        deadline: float | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("a request needs at least one prompt token")
        self.seq_id = seq_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.priority = priority
        self.cache_salt = cache_salt
        self.adapter_id = adapter_id
        self.eos_token_ids = eos_token_ids
        #: absolute monotonic time after which the request times out (None = no deadline)
        self.deadline = deadline
        self.times = RequestTimes() if arrival_time is None else RequestTimes(arrival=arrival_time)
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.status = SequenceStatus.QUEUED
        #: tokens whose K/V are in the cache (they will be after the current step's forward)
        self.num_computed_tokens = 0
        #: prompt tokens served from the prefix cache at the first schedule
        self.num_cached_tokens = 0
        #: chained hashes of the full blocks of ``all_token_ids`` (grown lazily by the KV manager)
        self.block_hashes: list[bytes] = []
        self.num_preemptions = 0
        self.finish_reason: FinishReason | None = None
        #: the stop string or token id that ended the request, if any
        self.stop_reason: str | int | None = None
        #: monotonically increasing number for FCFS ties
        self.seq_no = 0
        self._group: SequenceGroup | None = None
        #: token sequences ``bad_words`` bans, and the n-gram index ``no_repeat_ngram_size`` consults
        self.bad_word_ids: list[list[int]] = []
        self.ngram_index: dict[tuple[int, ...], set[int]] = {}
        #: where the output stands in its grammar (structured outputs); None = unconstrained
        self.grammar: GrammarMatcher | None = None
        #: the client is not draining its stream: do not schedule decode steps (BACKPRESSURED)
        self.paused = False
        #: this step's draft tokens (speculative decoding), scored after the sequence's last token and
        #: never part of its tokens until accepted; empty when it does not speculate
        self.spec_token_ids: list[int] = []
        #: the draft model's distributions the drafts were sampled from ([len(drafts), V]); None = a
        #: deterministic proposal (prompt lookup, or a greedy sequence)
        self.spec_draft_probs: torch.Tensor | None = None
        #: draft tokens verified for this sequence over its life, and how many were accepted
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        #: asynchronous scheduling: the row of its next token in the last step's sampled ids, still on the
        #: device and not yet in its tokens (``engine/in_flight.py``); None = every token it has is known
        self.pending_row: int | None = None

    @property
    def group(self) -> SequenceGroup:
        """The user request this sequence belongs to (set once by ``SequenceGroup.start`` or a fork)."""
        if self._group is None:
            raise RuntimeError(f"sequence {self.seq_id} belongs to no request yet")
        return self._group

    @group.setter
    def group(self, group: SequenceGroup) -> None:
        self._group = group

    # ---- tokens --------------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_pending(self) -> int:
        """Sampled tokens not yet in ``all_token_ids`` (0, or 1 under asynchronous scheduling)."""
        return 0 if self.pending_row is None else 1

    @property
    def num_tokens_ahead(self) -> int:
        """Its tokens with the one in flight: what the scheduler computes up to."""
        return len(self._all_token_ids) + (0 if self.pending_row is None else 1)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    @property
    def is_prefill_done(self) -> bool:
        return self.num_computed_tokens >= self.num_prompt_tokens

    def fork(self, child_id: str) -> Sequence:
        """A new sequence that continues from this one's tokens and computed KV (parallel samples, beams).
        It starts in this sequence's state; the KV manager shares the blocks by reference count."""
        child = Sequence(
            child_id,
            self.prompt_token_ids,
            self.params,
            arrival_time=self.times.arrival,
            priority=self.priority,
            cache_salt=self.cache_salt,
            adapter_id=self.adapter_id,
            prompt=self.prompt,
            eos_token_ids=self.eos_token_ids,
            deadline=self.deadline,
        )
        child.output_token_ids = list(self.output_token_ids)
        child._all_token_ids = list(self._all_token_ids)
        child.status = self.status
        child.num_computed_tokens = self.num_computed_tokens
        child.num_cached_tokens = self.num_cached_tokens
        child.times.first_scheduled = self.times.first_scheduled
        child.times.first_token = self.times.first_token
        child.times.last_token = self.times.last_token
        child.times.token_times = list(self.times.token_times)
        child.seq_no = self.seq_no
        child._group = self._group
        child.bad_word_ids = self.bad_word_ids
        child.ngram_index = {k: set(v) for k, v in self.ngram_index.items()}
        child.grammar = self.grammar.fork() if self.grammar is not None else None
        child.paused = self.paused
        return child

    # ---- state machine -------------------------------------------------------------------------------
    def transition(self, new: SequenceStatus) -> None:
        if new not in TRANSITIONS[self.status]:
            raise IllegalTransition(
                f"sequence {self.seq_id}: illegal transition {self.status.value} -> {new.value}"
            )
        self.status = new

    @property
    def is_finished(self) -> bool:
        return self.status.is_terminal

    def sort_key(self) -> tuple[int, float, int]:
        """Queue order: priority (lower value first), then arrival (FCFS), then admission order."""
        return (self.priority, self.times.arrival, self.seq_no)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
