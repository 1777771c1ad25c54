"""``LLMEngine``: owns the model, KV cache, scheduler and sampler; ``step()`` runs one scheduler tick.

Per tick (docs/architecture.md#engine-tick): expire deadlines → schedule (batch admission, token budget,
preemption) → one flattened forward → sample the rows whose sequences are fully computed (forking parallel
samples off a finished prompt, advancing beams) → append tokens, detokenize, check stop conditions → release
finished sequences; a request whose sequences are all done goes through the single reclaim routine.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections import abc
from pathlib import Path

import torch

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.distributed.executor import start_workers
from kvpilot.engine.distributed.step_message import KVOp
from kvpilot.engine.engine_setup import build_paged_kv, build_runner, load_served_model, memory_baseline
from kvpilot.engine.kv.events import KVEventLog
from kvpilot.engine.memory_profile import DeviceMemory
from kvpilot.engine.model.loader import (
    resolve_device,
    resolve_dtype,
    resolve_linear_backend,
    resolve_native_ops,
)
from kvpilot.engine.model.registry import default_cache_dir
from kvpilot.engine.output_processor import OutputProcessor
from kvpilot.engine.outputs import RequestOutput, TerminalRecord
from kvpilot.engine.request_intake import RequestIntake
from kvpilot.engine.request_validation import RequestError
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.sampler import Sampler
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.sequence import Sequence, SequenceStatus
from kvpilot.engine.sequence_group import SequenceGroup
from kvpilot.engine.sequence_registry import SequenceRegistry
from kvpilot.engine.spec_decode.draft_model import DraftModel
from kvpilot.engine.spec_decode.drafting import DraftContext, propose_drafts
from kvpilot.engine.stats import EngineStats
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.tokenizer import Tokenizer

S = SequenceStatus
log = logging.getLogger(__name__)
__all__ = ["LLMEngine", "RequestError"]


#: the id of the throwaway sequence ``admission_cost`` prices (refused as a request id: ``forget`` drops it)
_ADMISSION_PROBE_ID = "admission-probe"


class LLMEngine:
    def __init__(self, config: EngineConfig, device_memory: DeviceMemory | None = None) -> None:
        """``device_memory`` overrides where the profiled KV budget reads memory figures (tests; on CUDA it
        defaults to ``torch.cuda``)."""
        self.config = config
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.served_model_name = mc.served_model_name or mc.model
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        self.native_ops = resolve_native_ops(
            config.native_cpu_ops,
            self.device,
            self.dtype,
            Path(mc.download_dir) if mc.download_dir else default_cache_dir(),
        )
        memory = memory_baseline(config, self.device, device_memory)  # before any weights load
        #: ranks 1..tp-1 (docs/architecture.md#tensor-parallelism); None = one process holds the model
        self.tp_workers = start_workers(config, self.device)
        if self.tp_workers is not None:  # stopped by an engine dropped without shutdown() too
            weakref.finalize(self, self.tp_workers.shutdown)
        try:
            target = load_served_model(
                mc.model,
                config,
                self.device,
                self.dtype,
                self.linear_backend,
                self.native_ops,
                mc.quantization,
                self.tp_workers.rank if self.tp_workers is not None else None,
            )
        except BaseException:
            self.shutdown()
            raise
        self.model_dir, self.arch, self.backend, self.model = (
            target.model_dir,
            target.arch,
            target.backend,
            target.model,
        )
        arch = self.arch
        #: ``none``, ``gguf``, ``int8`` or ``fp8``: what the weights are kept as
        #: (docs/architecture.md#quantized-weights)
        self.quantization = target.quantization
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.kv_bytes_per_token = target.kv_bytes_per_token
        #: speculative decoding (docs/architecture.md#speculative-decoding); None = off
        self.speculative = spec = config.speculative_config
        self.draft_model = None
        if spec is not None and spec.method == "draft_model":
            assert spec.model is not None  # the config requires it for this method
            self.draft_model = DraftModel(self, spec.model)
        self.kv_events = KVEventLog()
        # a draft model's cache lives over the same blocks: a block costs both models' K/V
        draft_bytes = self.draft_model.kv_bytes_per_token if self.draft_model is not None else 0
        kv_ops: list[KVOp] | None = None if self.tp_workers is None else []
        paged = build_paged_kv(config, target, self.device, memory, self.kv_events, draft_bytes, kv_ops)
        self.kv_cache, self.pool, self.kv = paged.kv_cache, paged.pool, paged.kv
        if self.tp_workers is not None:
            self.tp_workers.allocate(self.kv_cache, self.kv.swap.num_blocks if self.kv.swap else 0)
        self.max_model_len = paged.max_model_len
        #: how the KV cache is sized (``/load``, ``kvpilot_cache_config_info``)
        self.kv_cache_sizing = paged.sizing
        self.model_identity = target.identity()
        if self.draft_model is not None:
            self.draft_model.check_context(self.max_model_len)
            self.draft_model.allocate_cache(
                self.kv_cache.num_blocks, cc.block_size, self.backend.kv_cache_layout
            )
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.runner = build_runner(config, target, paged, self.device, self.tp_workers, kv_ops)
        self.sampler = Sampler(
            torch.Generator(device=self.device).manual_seed(mc.seed),
            config.logprobs_mode,
            native=None if self.native_ops is None else self.native_ops.sampling,
        )
        self.eos_token_ids = frozenset(arch.eos_token_ids) | self.tokenizer.eos_token_ids
        #: structured outputs' grammars, compiled on their own threads
        #: (docs/architecture.md#structured-outputs)
        self.grammars = GrammarCompiler(self.tokenizer, arch.vocab_size, self.eos_token_ids)
        self.intake = RequestIntake(
            config, self.tokenizer, arch.vocab_size, self.max_model_len, self.eos_token_ids, self.grammars
        )
        self.stats = EngineStats()
        #: live sequences and user requests, and the terminal routine every request goes through
        self.registry = SequenceRegistry(self.scheduler, self.kv, self.stats, self.device)
        #: logits → tokens → outputs
        self.output_processor = OutputProcessor(
            self.registry,
            self.sampler,
            self.runner.input_batch,
            self.scheduler,
            self.tokenizer,
            self.stats,
            self.max_model_len,
            # on a GPU the host detokenizes a step's tokens while the device runs the next step's forward
            # (asynchronous scheduling does that for the whole of a step's output processing)
            defer_detokenize=self.device.type == "cuda"
            and not config.disable_async_output_proc
            and not config.async_scheduling,
            async_scheduling=config.async_scheduling,
        )
        #: what the draft-model proposer reads each step (None: no draft model)
        self._draft = (
            DraftContext(self.draft_model, self.kv, self.registry.generators, self.sampler.generator)
            if self.draft_model is not None
            else None
        )
        #: what the last step scheduled, for the server's per-request tracing: (request id, tokens computed
        #: before the step, new tokens) per scheduled sequence, and the ids of the requests it preempted
        self.last_step_scheduled: list[tuple[str, int, int]] = []
        self.last_step_preempted: list[str] = []

    @property
    def num_steps(self) -> int:
        return self.stats.steps

    @property
    def sequences(self) -> dict[str, Sequence]:
        """Live sequences by sequence id (``SequenceRegistry.sequences``)."""
        return self.registry.sequences

    @property
    def groups(self) -> dict[str, SequenceGroup]:
        """Live user requests by request id (``SequenceRegistry.groups``)."""
        return self.registry.groups

    @property
    def terminal_records(self) -> list[TerminalRecord]:
        """One record per ended request (``SequenceRegistry.terminal_records``; the server consumes them)."""
        return self.registry.terminal_records

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | abc.Sequence[int],
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        deadline: float | None = None,
    ) -> SequenceGroup:
        """Admit a request (tokenized here when given as text). Raises ``RequestError`` for bad input."""
        params = params or SamplingParams()
        if self.registry.in_use(request_id) or request_id == _ADMISSION_PROBE_ID:
            raise RequestError(f"request id {request_id!r} is already in use")
        seq, text = self.intake.first_sequence(
            request_id,
            prompt,
            params,
            arrival_time=arrival_time,
            priority=priority,
            cache_salt=cache_salt,
            deadline=deadline,
        )
        group = SequenceGroup.start(seq, text, self.tokenizer, self.max_model_len)
        self.registry.add(seq, group)
        self.scheduler.add_request(seq)
        return group

    def admission_cost(
        self, token_ids: list[int], params: SamplingParams, cache_salt: str | None = None
    ) -> int:
        """KV blocks admitting this request would reserve: its uncached prompt (after a prefix lookup) and
        the first block of each sample — the exact phase of two-phase admission,
        docs/architecture.md#admission."""
        probe = Sequence(_ADMISSION_PROBE_ID, token_ids, params, cache_salt=cache_salt)
        cost = self.scheduler.reservation_for(probe)
        self.kv.forget(probe)  # drop the probe's record (its cached extra keys)
        return cost

    def admission_headroom(self) -> int:
        """Blocks not yet promised to queued requests (free blocks minus outstanding reservations)."""
        return self.kv.admission_headroom()

    def abort_request(self, request_id: str, status: SequenceStatus = S.CANCELLED) -> bool:
        """Cancel / time out / fail a live request. Idempotent: False when it had already ended."""
        # a stop string found first ends it as it would have; other requests' wait for the next step
        self.output_processor.appender.flush_deferred(request_id)
        return self.registry.abort(request_id, status)

    def set_backpressure(self, request_id: str, paused: bool) -> None:
        """A slow stream consumer: ``paused`` sequences keep their blocks but get no decode steps."""
        self.registry.set_paused(request_id, paused)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def has_pending_outputs(self) -> bool:
        """``step`` has outputs to return even with nothing unfinished: an ended request's last one."""
        return self.registry.has_pending_outputs

    def check_health(self) -> None:
        """Raise when the engine cannot compute another step (a tensor-parallel rank has died); the server
        loop calls it between steps, so a dead rank fails the engine while it is idle too."""
        if self.tp_workers is not None:
            self.tp_workers.check()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any, and wait for them (idempotent)."""
        if self.tp_workers is not None:
            self.tp_workers.shutdown()

    # ---- the tick ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.output_processor.appender.expire(time.monotonic())
        start = time.perf_counter()
        if self.speculative is not None:
            propose_drafts(self.scheduler.running, self.speculative, self.max_model_len, self._draft)
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        self.last_step_scheduled = [(r.group.request_id, r.num_computed_tokens, n) for r, n in out.scheduled]
        self.last_step_preempted = [r.group.request_id for r in out.preempted]
        now = time.monotonic()
        for req, _ in out.scheduled:
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
                self.stats.prefix_cache_queries += req.num_prompt_tokens
                self.stats.prefix_cache_hits += req.num_cached_tokens
        processor = self.output_processor
        if not out.is_empty:
            in_flight = processor.in_flight
            batch = self.runner.build_batch(out.scheduled, None if in_flight is None else in_flight.ids)
            logits = self.runner.execute(batch)
            if self.draft_model is not None:
                self.draft_model.observe(batch)  # its cache follows the target's, slot for slot
            self.scheduler.update_after_step(out)
            # a speculating sequence's tokens are a decode's (its drafts are dropped once verified)
            prefill = sum(
                n
                for r, n in out.scheduled
                if (n > 1 and not r.spec_token_ids) or r.num_output_tokens + r.num_pending == 0
            )
            # the previous step's text and stop strings (asynchronous scheduling: its tokens) while the
            # device computes this step's forward
            processor.appender.flush_deferred()
            processor.resolve_in_flight()
            num_rows = sum(batch.sample_row_counts)
            self.output_processor.record_prompt_logprobs(batch, logits)
            if num_rows:
                self.output_processor.sample(
                    batch.sampling_sequences, logits[:num_rows], batch.sample_row_counts
                )
            self.stats.prompt_tokens += prefill
            self.stats.record_step(time.perf_counter() - start, prefill, out.num_batched_tokens - prefill)
        else:
            processor.appender.flush_deferred()
            processor.resolve_in_flight()
        return self.registry.drain_outputs()  # one output per changed request

    # ---- introspection -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.runner.input_batch.check()
        # a record covers blocks, swap, reservation and hash keys: none may outlive its sequence
        assert self.kv.sequence_ids <= self.sequences.keys(), "a released sequence still has a KV record"
        for seq in self.sequences.values():
            assert not seq.is_finished, f"finished sequence {seq.seq_id} is still registered"
