"""Token-budget scheduler: continuous batching with chunked prefill, priorities and preemption.

Each ``schedule()`` call is one tick (docs/architecture.md#scheduling): it fills a budget of
``max_num_batched_tokens`` with running requests first (one token per decode, then the next chunk of each
unfinished prefill), then swaps requests back in, then admits waiting requests in queue order (priority, then
arrival) as long as their blocks can be allocated and the sequence cap allows. Scheduling is in tokens, not
phases: a request simply asks for ``num_tokens - num_computed_tokens`` more tokens, whether those are prompt
or output (under asynchronous scheduling ``num_tokens_ahead``: a sampled token still in flight counts).

Preemption (when a running request cannot get blocks for its next tokens): the victim is the running
request with the lowest priority (largest value), latest arrival among those not yet scheduled in this
tick — possibly the request itself. ``recompute`` frees its blocks and requeues it (its arrival keeps it
at the front of its priority class); ``swap`` copies its blocks to host memory first (falling back to
recompute when the swap space is full). Merely descheduling a request does not free memory and is never
used as a memory remedy. A waiting request never preempts a running one; priority decides queue order.
The one exception is within a beam search: beams that wait, with nothing to compute, for a beam of their
search that is out of the cache leave it too at the start of a tick (docs/architecture.md#scheduling).
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass, field

from kvpilot.engine.config import SchedulerConfig
from kvpilot.engine.kv.capacity import blocks_for_tokens
from kvpilot.engine.kv.manager import KVCacheManager
from kvpilot.engine.sequence import Sequence, SequenceStatus

S = SequenceStatus


@dataclass
class SchedulerOutput:
    #: (request, number of new tokens) in batch order: one-token sequences first, then prefill/extend
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    swapped_in: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, max_model_len: int) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self.max_model_len = max_model_len
        #: admitted requests without device blocks, kept sorted by ``Sequence.sort_key``
        self.waiting: list[Sequence] = []
        #: requests holding device blocks (incl. backpressured ones), sorted by ``sort_key``
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self._counter = itertools.count()
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------------------
    def reservation_for(self, req: Sequence) -> int:
        """Blocks a queued request is promised: its uncached prompt and first token, plus one block for
        each further parallel sample (they share the prompt's blocks: M_prompt + n·M_generated)."""
        uncached = req.num_tokens - self.kv.count_prefix_hit_tokens(req)
        return blocks_for_tokens(uncached + 1, self.block_size) + req.params.num_samples - 1

    def add_request(self, req: Sequence) -> None:
        req.seq_no = next(self._counter)
        self.kv.reserve(req, self.reservation_for(req))
        bisect.insort(self.waiting, req, key=Sequence.sort_key)

    def add_running(self, req: Sequence) -> None:
        """A forked sequence that already holds (shared) blocks joins the running set."""
        bisect.insort(self.running, req, key=Sequence.sort_key)

    def add_preempted(self, req: Sequence) -> None:
        """A forked sequence without blocks (its parent was preempted) waits to be recomputed."""
        bisect.insort(self.waiting, req, key=Sequence.sort_key)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- the tick ------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled_ids: set[str] = set()
        preempted_ids: set[str] = set()

        self._evict_stalled_beams(out)
        # 1) running requests, highest priority first; decodes before prefill chunks, so a long prompt
        #    ahead of them in priority never takes the tokens they need (their count is <= max_num_seqs)
        for req in sorted(self.running, key=lambda r: r.num_tokens_ahead - r.num_computed_tokens > 1):
            if budget <= 0:
                break
            if req.seq_id in preempted_ids or req.status is S.BACKPRESSURED:
                continue
            if req.pending_row is not None and self._ends_at_length(req):
                continue  # its token in flight is its last (max_tokens, context): no step to compute for it
            if req.paused and req.status is S.DECODE:
                req.transition(S.BACKPRESSURED)  # holds its blocks, gets no decode steps until drained
                continue
            # draft tokens (speculative decoding) ride on a decode; the budget and the cache may cut them
            n = min(req.num_tokens_ahead - req.num_computed_tokens + len(req.spec_token_ids), budget)
            if n <= 0:
                continue
            if len(req.spec_token_ids) >= n:  # the budget cuts the draft (and what was allocated for it)
                del req.spec_token_ids[n - 1 :]
                self.kv.truncate(req, req.num_computed_tokens + n)
            while not self.kv.allocate(req, n):
                if req.spec_token_ids:  # drafts are optional: drop them before anything is preempted
                    n -= len(req.spec_token_ids)
                    req.spec_token_ids, req.spec_draft_probs = [], None
                    continue
                if self._drop_waiting_drafts(req, scheduled_ids):
                    continue
                victim = self._pick_victim(scheduled_ids)
                self._preempt(victim, out)
                preempted_ids.add(victim.seq_id)
                if victim is req:
                    break
            if req.seq_id in preempted_ids:
                continue
            self._take(req, n, out, scheduled_ids)
            budget -= n

        # 2) swapped requests come back before new work, unless this tick had to preempt
        if not out.preempted:
            for req in list(self.swapped):
                if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                    break
                n = min(req.num_tokens_ahead - req.num_computed_tokens, budget)
                if not n:
                    continue  # a beam waiting for its siblings' distributions: back once it has a token
                if not self.kv.swap_in(req, n):
                    break
                self.swapped.remove(req)
                req.transition(S.RUNNABLE)
                bisect.insort(self.running, req, key=Sequence.sort_key)
                out.swapped_in.append(req)
                self._take(req, n, out, scheduled_ids)
                budget -= n

        # 3) waiting requests in queue order (head-of-line: stop at the first that does not fit)
        static_busy = self.config.batching_mode == "static" and bool(self.running or out.scheduled)
        # (a swapped beam with nothing to compute waits for its siblings, which may be among these)
        if not out.preempted and not any(_has_work(r) for r in self.swapped):
            reserving = self.config.reserved_output_fraction > 0.0
            promised = sum(self._output_reserve(r) for r in self.running) if reserving else 0
            while self.waiting and budget > 0:
                req = self.waiting[0]
                if static_busy and req.status is not S.PREEMPTED:
                    break  # a static batch takes new requests once it has finished; its own come back
                seats = self._seats(req)
                if len(self.running) + seats > self.config.max_num_seqs:
                    break
                # prompt logprobs need every prompt position's logits, so such requests compute it all
                hits = [] if req.params.prompt_logprobs is not None else self.kv.lookup_prefix(req)
                remaining = req.num_tokens_ahead - len(hits) * self.block_size
                # a preempted sequence recomputes its prompt and output, which together may exceed any
                # budget: that recompute is chunked whatever enable_chunked_prefill says
                if (
                    not self.config.enable_chunked_prefill
                    and remaining > budget
                    and req.status is not S.PREEMPTED
                ):
                    break
                n = min(remaining, budget)
                if reserving:
                    future = self._output_reserve(
                        req, blocks_for_tokens(len(hits) * self.block_size + n, self.block_size), seats
                    )
                    if (
                        self.running
                        and self.kv.blocks_to_allocate(req, n, hits) + future + promised
                        > self.kv.pool.num_free
                    ):
                        break  # the outputs already running (and this one's) keep their share of the cache
                    promised += future
                if not self.kv.allocate(req, n, hits):
                    break
                self.waiting.pop(0)
                self.kv.release_reservation(req)
                req.num_computed_tokens = len(hits) * self.block_size
                if req.status is not S.PREEMPTED:
                    req.num_cached_tokens = req.num_computed_tokens
                req.transition(S.RUNNABLE)
                bisect.insort(self.running, req, key=Sequence.sort_key)
                self._take(req, n, out, scheduled_ids)
                budget -= n

        out.scheduled.sort(key=lambda item: item[1] != 1)  # stable: one-token sequences first
        return out

    def _ends_at_length(self, req: Sequence) -> bool:
        """Whether the token ``req`` has in flight (asynchronous scheduling) ends it whatever it is: its
        ``max_tokens``, or the context limit."""
        max_tokens = req.params.max_tokens
        return req.num_tokens_ahead >= self.max_model_len or (
            max_tokens is not None and req.num_output_tokens + req.num_pending >= max_tokens
        )

    def _output_reserve(self, req: Sequence, held: int | None = None, samples: int = 1) -> int:
        """Blocks ``reserved_output_fraction`` keeps free for ``req``'s growth beyond the ``held`` blocks
        (default: its table): the rest of its prompt, then up to that share of its output budget for each
        of its ``samples`` (forked samples share the prompt's blocks and grow apart)."""
        fraction = self.config.reserved_output_fraction
        held = len(self.kv.block_table(req)) if held is None else held
        prompt = blocks_for_tokens(req.num_prompt_tokens, self.block_size)
        room = self.max_model_len - req.num_prompt_tokens
        budget = min(req.params.max_tokens if req.params.max_tokens is not None else room, room)
        target = blocks_for_tokens(req.num_prompt_tokens + math.ceil(fraction * budget), self.block_size)
        return max(0, prompt - held) + samples * max(0, target - max(held, prompt))

    @staticmethod
    def _seats(req: Sequence) -> int:
        """Batch sequences admitting ``req`` will take: all its parallel samples when they are still to be
        forked from its prompt (forks join the running set without passing admission), else one."""
        group = req.group
        if group is not None and req.num_output_tokens == 0 and len(group.samples) == 1:
            return req.params.num_samples
        return 1

    def _take(self, req: Sequence, n: int, out: SchedulerOutput, scheduled_ids: set[str]) -> None:
        out.scheduled.append((req, n))
        scheduled_ids.add(req.seq_id)

    def _drop_waiting_drafts(self, req: Sequence, scheduled_ids: set[str]) -> bool:
        """Release the draft slots of running sequences not scheduled yet this tick (a draft model's
        proposer allocated them before the schedule): cheaper than preempting anyone for ``req``. Returns
        whether any block was freed."""
        free_before = self.kv.pool.num_free
        for seq in self.running:
            if seq.spec_token_ids and seq is not req and seq.seq_id not in scheduled_ids:
                seq.spec_token_ids, seq.spec_draft_probs = [], None
                self.kv.truncate(seq, seq.num_tokens_ahead)
        return self.kv.pool.num_free > free_before

    def _pick_victim(self, scheduled_ids: set[str]) -> Sequence:
        """Lowest priority, latest arrival among running requests not yet scheduled this tick."""
        for cand in reversed(self.running):
            if cand.seq_id not in scheduled_ids:
                return cand
        raise RuntimeError("no preemption victim: every running request is already scheduled")

    def _evict_stalled_beams(self, out: SchedulerOutput) -> None:
        """Running beams that have reported their distribution and wait for a beam of their search that is
        out of the cache with tokens to compute leave it too (same preemption mode): they have nothing to
        compute until it reports, and the blocks they hold may be the ones it, or any other request, needs
        to come back (docs/architecture.md#scheduling)."""
        idle = [
            r for r in self.running if r.group is not None and r.group.beam is not None and not _has_work(r)
        ]
        if not idle:
            return
        waiting_for = {
            id(r.group)
            for r in itertools.chain(self.waiting, self.swapped)
            if r.group is not None and _has_work(r)
        }
        for seq in idle:
            if id(seq.group) in waiting_for:
                self._preempt(seq, out)

    def _preempt(self, req: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.num_preemptions += 1
        req.num_preemptions += 1
        req.spec_token_ids, req.spec_draft_probs = [], None
        out.preempted.append(req)
        if self.config.preemption_mode == "swap" and self.kv.can_swap_out(req):
            self.kv.swap_out(req)
            req.transition(S.SWAPPED)
            bisect.insort(self.swapped, req, key=Sequence.sort_key)
            return
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.transition(S.PREEMPTED)
        bisect.insort(self.waiting, req, key=Sequence.sort_key)

    # ---- after the forward ---------------------------------------------------------------------------
    def update_after_step(self, out: SchedulerOutput) -> list[Sequence]:
        """Advance computed counts; return the requests whose logits are sampled this step (their whole
        known sequence is now computed)."""
        sampled: list[Sequence] = []
        for req, n in out.scheduled:
            # draft tokens' K/V count once verification accepts them (``spec_decode``)
            n -= len(req.spec_token_ids)
            req.num_computed_tokens += n
            # a token in flight is not known yet: its block is cached at a later step's update
            self.kv.commit_computed(req, min(req.num_computed_tokens, req.num_tokens))
            if req.status is S.RUNNABLE:
                # a resumed request with output that only needs its next token is decoding again
                req.transition(S.DECODE if n == 1 and req.num_output_tokens else S.PREFILL)
            if req.num_computed_tokens >= req.num_tokens_ahead:
                sampled.append(req)
        return sampled

    # ---- leaving -------------------------------------------------------------------------------------
    def rollback_drafts(self, req: Sequence, num_accepted: int) -> None:
        """After verification: ``num_accepted`` of ``req``'s drafts are its tokens now, and their K/V
        computed; the rejected ones' slots are released (the block table shrinks to the blocks its tokens
        need), so nothing but committed tokens is ever cached."""
        req.spec_token_ids, req.spec_draft_probs = [], None
        req.num_computed_tokens += num_accepted
        self.kv.commit_computed(req, req.num_computed_tokens)
        self.kv.truncate(req, req.num_tokens)

    def remove(self, req: Sequence) -> None:
        """Take a request out of whichever queue holds it (used by the reclaim routine)."""
        for queue in (self.waiting, self.running, self.swapped):
            if req in queue:
                queue.remove(req)
                return


def _has_work(seq: Sequence) -> bool:
    """Whether ``seq`` has tokens to compute (a beam that has reported its distribution has none until its
    search's next selection)."""
    return seq.num_tokens_ahead - seq.num_computed_tokens > 0
