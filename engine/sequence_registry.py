"""The engine's live sequences and user requests, and the one way each of them leaves.

A ``Sequence`` is one sequence (a prompt and the tokens generated after it); a ``SequenceGroup`` is the user's
request: one sequence for plain sampling, several for ``best_of`` samples or beams. The registry holds both by
id, the seeded generators of sequences whose request gave a seed, the terminal records, and which requests
have something new for the next outputs.

- ``fork``: a sample or beam branching off a sequence, sharing its KV blocks by reference count.
- ``release``: one sequence's resources (blocks by reference count, reservation, batch slot, generator).
- ``reclaim``: the single terminal routine of a user request (docs/architecture.md#engine-tick), whatever
  ended it: idempotent, releases every sequence, rolls back a queued reservation, writes exactly one terminal
  record. ``abort`` (cancel, time out, fail) and ``expire`` (deadlines passed) end requests through it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from kvpilot.engine.outputs import RequestOutput, TerminalRecord
from kvpilot.engine.sequence import FinishReason, Sequence, SequenceStatus
from kvpilot.engine.sequence_group import SequenceGroup
from kvpilot.engine.stats import EngineStats

if TYPE_CHECKING:
    from kvpilot.engine.kv.manager import KVCacheManager
    from kvpilot.engine.scheduler import Scheduler

S = SequenceStatus
#: the finish reason each way of aborting a request reports
_ABORT_REASONS = {
    S.CANCELLED: FinishReason.ABORT,
    S.TIMED_OUT: FinishReason.TIMEOUT,
    S.FAILED: FinishReason.ERROR,
}
_SEED_STRIDE = 0x9E3779B97F4A7C15  # sample i of a seeded request draws from seed + i·stride (mod 2^63)


class SequenceRegistry:
    def __init__(
        self, scheduler: Scheduler, kv: KVCacheManager, stats: EngineStats, device: torch.device
    ) -> None:
        self._scheduler, self._kv, self._stats, self._device = scheduler, kv, stats, device
        #: live sequences by sequence id (a fork's id is its request's id + ``#i`` / ``#bi``)
        self.sequences: dict[str, Sequence] = {}
        #: live user requests by request id
        self.groups: dict[str, SequenceGroup] = {}
        #: the generator of each sequence whose request gave a seed (None: the engine's shared one)
        self.generators: dict[str, torch.Generator] = {}
        #: one record per ended request, in the order they ended (the server consumes them)
        self.terminal_records: list[TerminalRecord] = []
        self._pending_outputs: dict[str, SequenceGroup] = {}

    def in_use(self, request_id: str) -> bool:
        return request_id in self.groups or request_id in self.sequences

    def add(self, seq: Sequence, group: SequenceGroup) -> None:
        """Register a new request's first sequence (its generator seeded by ``params.seed``)."""
        seed = seq.params.seed
        if seed is not None:
            self.generators[seq.seq_id] = torch.Generator(device=self._device).manual_seed(seed)
        self.sequences[seq.seq_id] = seq
        self.groups[group.request_id] = group

    @property
    def has_pending_outputs(self) -> bool:
        return bool(self._pending_outputs)

    def touched(self, group: SequenceGroup) -> None:
        """``group`` has something new for the next ``drain_outputs``."""
        self._pending_outputs[group.request_id] = group

    def fork(self, parent: Sequence, child_id: str, sample_index: int) -> Sequence:
        """Sample or beam ``sample_index`` of ``parent``'s request, sharing ``parent``'s KV blocks."""
        child = parent.fork(child_id)
        resident = parent.status not in (S.PREEMPTED, S.SWAPPED)
        if resident:
            self._kv.fork(parent, child)
        else:
            # a beam preempted while it waited for its siblings: its KV is not on the device to share, so
            # the fork recomputes it (from prefix-cache hits where the blocks survive)
            child.status, child.num_computed_tokens = S.PREEMPTED, 0
        seed = parent.params.seed
        if seed is not None:
            gen_seed = (seed + sample_index * _SEED_STRIDE) % (1 << 63)
            self.generators[child_id] = torch.Generator(device=self._device).manual_seed(gen_seed)
        self.sequences[child_id] = child
        if resident:
            self._scheduler.add_running(child)
        else:
            self._scheduler.add_preempted(child)
        parent.group.new_sample(child, len(parent.group.samples))
        return child

    def release(self, seq: Sequence, status: SequenceStatus, reason: FinishReason) -> None:
        """Free one sequence's resources (blocks by reference count, reservation, batch slot)."""
        if seq.is_finished:
            return
        seq.transition(status)
        seq.finish_reason = reason
        seq.times.finished = time.monotonic()
        self._scheduler.remove(seq)
        self._kv.forget(seq)
        self.generators.pop(seq.seq_id, None)
        self.sequences.pop(seq.seq_id, None)

    def reclaim(self, group: SequenceGroup, status: SequenceStatus, reason: FinishReason) -> bool:
        """End a user request. Idempotent: a second call (a cancel racing a timeout, a cancel after
        completion) changes nothing and returns False."""
        if group.finished:
            return False
        for sample in group.live_samples():
            group.on_finish(sample, reason, None)
            self.release(sample.seq, status, reason)
        for sample in group.samples:  # beams pruned earlier still hold nothing; make sure
            self.release(sample.seq, status, reason)
        group.finished = True
        group.status = status.value
        self.groups.pop(group.request_id, None)
        self._stats.finished[reason.value] += 1
        self.terminal_records.append(_terminal_record(group, status, reason))
        self.touched(group)
        return True

    def abort(self, request_id: str, status: SequenceStatus) -> bool:
        """End a live request as CANCELLED, TIMED_OUT or FAILED; False when it had already ended."""
        group = self.groups.get(request_id)
        return group is not None and self.reclaim(group, status, _ABORT_REASONS[status])

    def set_paused(self, request_id: str, paused: bool) -> None:
        """Pause or resume a live request's decodes (a slow stream consumer; its blocks stay)."""
        group = self.groups.get(request_id)
        for sample in group.live_samples() if group else []:
            sample.seq.paused = paused
            if not paused and sample.seq.status is S.BACKPRESSURED:
                sample.seq.transition(S.DECODE)

    def expired(self, now: float) -> list[SequenceGroup]:
        """The live requests whose deadline has passed at ``now`` (monotonic seconds)."""
        return [
            g for g in self.groups.values() if g.primary.deadline is not None and now >= g.primary.deadline
        ]

    def expire(self, now: float) -> None:
        """Time out every request whose deadline has passed at ``now``."""
        for group in self.expired(now):
            self.reclaim(group, S.TIMED_OUT, FinishReason.TIMEOUT)

    def drain_outputs(self) -> list[RequestOutput]:
        """The outputs of every request touched since the last call (``final_only`` ones only at the end)."""
        outs = [g.make_output(g.primary.num_cached_tokens) for g in self._pending_outputs.values()]
        self._pending_outputs = {}
        return [o for o in outs if o is not None]


def _terminal_record(group: SequenceGroup, status: SequenceStatus, reason: FinishReason) -> TerminalRecord:
    completions = group.completions()
    committed = sum(len(c.token_ids) for c in completions)
    primary = group.primary
    return TerminalRecord(
        request_id=group.request_id,
        status=status.value,
        finish_reason=reason.value,
        num_generated=(
            group.beam.num_scored
            if group.beam is not None
            else sum(s.seq.num_output_tokens for s in group.samples)
        ),
        num_emitted=committed if group.hides_samples else sum(s.num_emitted for s in group.samples),
        num_committed=committed,
        num_prompt_tokens=primary.num_prompt_tokens,
        num_cached_tokens=primary.num_cached_tokens,
        num_preemptions=sum(s.seq.num_preemptions for s in group.samples),
        num_draft_tokens=sum(s.seq.num_draft_tokens for s in group.samples),
        num_accepted_tokens=sum(s.seq.num_accepted_tokens for s in group.samples),
        timings={
            "arrival": primary.times.arrival,
            "first_scheduled": primary.times.first_scheduled,
            "first_token": primary.times.first_token,
            "finished": time.monotonic(),
        },
    )
