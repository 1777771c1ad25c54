"""Speculative-decoding metrics (docs/metrics.md, docs/architecture.md#speculative-decoding), as vLLM counts
them: verifications of a draft, draft tokens scored, drafts accepted (overall and by position in the draft),
and the acceptance length (tokens emitted per verification, 1 to k + 1) as a histogram. Fed from engine-stat
deltas on the engine thread after each step."""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvpilot.engine.stats import EngineStats

LENGTH_BUCKETS = tuple(float(n) for n in range(1, 18))


class SpecDecodeMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self._model = model_name

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, ["model_name"], registry=registry)

        self.num_drafts = counter(
            "kvpilot_spec_decode_num_drafts_total", "Verifications of a draft (one per sequence per step)."
        ).labels(model_name)
        self.num_draft_tokens = counter(
            "kvpilot_spec_decode_num_draft_tokens_total", "Draft tokens proposed and scored by the target."
        ).labels(model_name)
        self.num_accepted_tokens = counter(
            "kvpilot_spec_decode_num_accepted_tokens_total", "Draft tokens the exact rule accepted."
        ).labels(model_name)
        self._per_position = Counter(
            "kvpilot_spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted draft tokens by their position in the draft (0 = the first).",
            ["model_name", "position"],
            registry=registry,
        )
        self._length = Histogram(
            "kvpilot_spec_decode_acceptance_length",
            "Tokens one verification emits: the accepted drafts plus the target's own next token.",
            ["model_name"],
            registry=registry,
            buckets=LENGTH_BUCKETS,
        ).labels(model_name)
        self._last = self._snapshot(EngineStats())

    @staticmethod
    def _snapshot(stats: EngineStats) -> tuple[int, int, int, list[int], Tally]:
        return (
            stats.spec_num_drafts,
            stats.spec_draft_tokens,
            stats.spec_accepted_tokens,
            list(stats.spec_accepted_per_position),
            Tally(stats.spec_acceptance_lengths),
        )

    def start(self, stats: EngineStats) -> None:
        """Count from here (after warm-up)."""
        self._last = self._snapshot(stats)

    def after_step(self, stats: EngineStats) -> None:
        now = self._snapshot(stats)
        drafts, tokens, accepted, per_pos, lengths = now
        before = self._last
        if drafts == before[0]:
            return
        self.num_drafts.inc(drafts - before[0])
        self.num_draft_tokens.inc(tokens - before[1])
        self.num_accepted_tokens.inc(accepted - before[2])
        for pos, count in enumerate(per_pos):
            delta = count - (before[3][pos] if pos < len(before[3]) else 0)
            if delta:
                self._per_position.labels(self._model, str(pos)).inc(delta)
        for length, count in (lengths - before[4]).items():
            for _ in range(count):
                self._length.observe(length)
        self._last = now
