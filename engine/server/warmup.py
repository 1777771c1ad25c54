"""Warm-up before ``/ready``: kernel tuning (Triton on CUDA), the capture of the decode graphs (CUDA,
unless ``--enforce-eager``), and forward passes over the configured batch/length buckets through the
real engine path (add_request → step → sample → detokenize → reclaim), so the first real requests do not
pay for lazy initialisation, allocator growth or kernel compilation
(docs/architecture.md#readiness-and-warm-up). Runs on the engine thread, before the engine loop serves
anything.

Warm-up prompts carry their own cache salt, so their cached blocks can never be hit by a real request;
they are the least recently used blocks and are evicted first.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.server.config import WarmupBucket

if TYPE_CHECKING:  # torch: only the engine thread imports the engine
    from kvpilot.engine.engine_core import LLMEngine

WARMUP_SALT = "kvpilot-warmup"


def effective_buckets(
    buckets: tuple[WarmupBucket, ...],
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
) -> list[WarmupBucket]:
    """The configured buckets clipped to what this engine can run (prompt + 2 output tokens must fit the
    context, a batch never exceeds max_num_seqs, a prompt fits one step when prefill is not chunked)."""
    longest = max_model_len - 2 if chunked_prefill else min(max_model_len - 2, max_num_batched_tokens)
    out: list[WarmupBucket] = []
    for b in buckets:
        clipped = WarmupBucket(min(b.batch_size, max_num_seqs), max(1, min(b.prompt_len, longest)))
        if clipped not in out:
            out.append(clipped)
    return out


def warmup_prompt(bucket: WarmupBucket, index: int, vocab_size: int) -> list[int]:
    """Distinct deterministic token ids per request (no shared prefix, so every prompt is computed)."""
    return [(index * 7919 + 31 * j + 3) % vocab_size for j in range(bucket.prompt_len)]


def run_warmup(
    engine: LLMEngine,
    buckets: list[WarmupBucket],
    on_bucket: Callable[[int, WarmupBucket], None],
    on_phase: Callable[[str, float], None],
) -> None:
    """Tune kernels (when the backend has anything to tune), capture the decode graphs (with the tuned
    tile configs, which they bake in; the buckets' decode steps then replay them), then run each bucket to
    completion. ``on_bucket(i, bucket)`` is called before bucket ``i`` runs; ``on_phase(name, seconds)``
    after ``kernel_tuning`` and ``graph_capture``."""
    if engine.device.type == "cuda":
        start = time.monotonic()
        first = engine.kv_cache.layers[0]
        sc = engine.config.scheduler
        engine.backend.warmup(
            first.key, first.value, sc.max_num_seqs, sc.max_num_batched_tokens, engine.max_model_len
        )
        on_phase("kernel_tuning", time.monotonic() - start)
    graphs = engine.runner.decode_graphs
    if graphs is not None and graphs.captured is None:  # else the first decode step would capture them
        start = time.monotonic()
        graphs.capture_all()  # a failed capture is logged and leaves the engine eager
        on_phase("graph_capture", time.monotonic() - start)
    out_tokens = 2
    params = SamplingParams(
        max_tokens=out_tokens, min_tokens=out_tokens, temperature=0.0, ignore_eos=True, detokenize=True
    )
    vocab = engine.arch.vocab_size
    for i, bucket in enumerate(buckets):
        on_bucket(i, bucket)
        ids = [f"warmup-{i}-{j}" for j in range(bucket.batch_size)]
        for j, rid in enumerate(ids):
            prompt = warmup_prompt(bucket, i * 1000 + j, vocab)
            engine.add_request(rid, prompt, params, cache_salt=WARMUP_SALT)
        # each step computes at least one of the bucket's tokens (twice that allows for recomputation after
        # a preemption): a warm-up that cannot finish fails the start instead of hanging it
        for _ in range(2 * bucket.batch_size * (bucket.prompt_len + out_tokens)):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        if engine.has_unfinished_requests():
            raise RuntimeError(f"warm-up bucket {bucket} did not finish")
    engine.terminal_records.clear()
