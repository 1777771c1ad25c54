"""``LLMEngine``: owns the model, KV cache, scheduler and sampler; ``step()`` runs one scheduler tick.

Per tick (seed §5.1): expire deadlines → schedule (admission to the batch, token budget, preemption) →
one flattened forward → sample the rows whose sequences are fully computed → append tokens, check stop
conditions → reclaim every request that reached a terminal state through the single reclaim routine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kvpilot.engine.attention.backend import select_backend
from kvpilot.engine.config import DEFAULT_CPU_KV_CACHE_BYTES, ConfigError, EngineConfig
from kvpilot.engine.kv.block_hash import root_hash
from kvpilot.engine.kv.block_pool import BlockPool
from kvpilot.engine.kv.capacity import kv_bytes_per_token, num_blocks_for_memory
from kvpilot.engine.kv.events import KVEventLog
from kvpilot.engine.kv.kv_cache import HostSwapSpace, KVCache
from kvpilot.engine.kv.manager import KVCacheManager
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.loader import load_model, resolve_device, resolve_dtype, resolve_linear_backend
from kvpilot.engine.model.registry import model_fingerprint, resolve_model
from kvpilot.engine.model_runner import ModelRunner
from kvpilot.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TerminalRecord
from kvpilot.engine.request import FinishReason, Request, RequestStatus
from kvpilot.engine.sampling.params import SamplingParams
from kvpilot.engine.sampling.sampler import Sampler
from kvpilot.engine.scheduler import Scheduler
from kvpilot.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
S = RequestStatus


class RequestError(ValueError):
    """A request cannot be served as given (e.g. prompt longer than the context); message says why."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc, cc = config.model, config.cache
        self.device = resolve_device(mc.device)
        self.dtype = resolve_dtype(mc.dtype, self.device)
        self.model_dir = resolve_model(mc.model, cache_dir=mc.download_dir)
        self.arch = ModelArchConfig.from_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        self.served_model_name = mc.served_model_name or mc.model
        arch = self.arch
        self.backend = select_backend(config.attention_backend, self.device, num_heads=arch.num_attention_heads,
                                      num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
                                      scale=arch.head_dim ** -0.5, sliding_window=arch.sliding_window)
        self.linear_backend = resolve_linear_backend(config.linear_backend, self.device, self.dtype)
        self.model = load_model(self.model_dir, self.dtype, self.device, self.backend, self.linear_backend,
                                batch_hint=min(config.scheduler.max_num_seqs, 64))

        self.kv_bytes_per_token = kv_bytes_per_token(arch.num_hidden_layers, arch.num_key_value_heads,
                                                     arch.head_dim, self.dtype.itemsize)
        num_blocks = self._num_kv_blocks()
        capacity_tokens = (num_blocks - 1) * cc.block_size
        self.max_model_len = self._max_model_len(capacity_tokens)
        self.kv_cache = KVCache(arch.num_hidden_layers, num_blocks, cc.block_size, arch.num_key_value_heads,
                                arch.head_dim, self.dtype, self.device, layout=self.backend.kv_cache_layout)
        swap = None
        if cc.swap_space > 0:
            swap_blocks = int(cc.swap_space * (1 << 30)) // (self.kv_bytes_per_token * cc.block_size)
            swap = HostSwapSpace(self.kv_cache, max(1, swap_blocks))
        self.kv_events = KVEventLog()
        self.model_identity = f"{model_fingerprint(self.model_dir)}:{self.dtype}"
        self.pool = BlockPool(num_blocks, cc.enable_prefix_caching, self.kv_events)
        self.kv = KVCacheManager(self.pool, cc.block_size, root_hash(self.model_identity), self.kv_cache, swap)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.max_model_len)
        self.runner = ModelRunner(self.model, self.kv_cache, self.device)
        self.sampler = Sampler(torch.Generator(device=self.device).manual_seed(mc.seed))
        self.requests: dict[str, Request] = {}
        self._generators: dict[str, torch.Generator] = {}
        self.terminal_records: list[TerminalRecord] = []
        self._finished_outputs: list[RequestOutput] = []
        self.num_steps = 0

    # ---- set-up helpers ------------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        cc = self.config.cache
        if cc.num_kv_blocks is not None:
            return cc.num_kv_blocks
        budget = cc.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _total = torch.cuda.mem_get_info(self.device)
                budget = int(free * cc.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = num_blocks_for_memory(budget, self.kv_bytes_per_token, cc.block_size)
        if blocks < 2:
            raise ConfigError(f"KV budget of {budget} bytes holds {blocks} blocks of {cc.block_size} tokens "
                              f"({self.kv_bytes_per_token} bytes/token); need at least 2")
        return blocks

    def _max_model_len(self, capacity_tokens: int) -> int:
        wanted = self.config.model.max_model_len
        limit = self.arch.max_position_embeddings
        if wanted is not None:
            if wanted > limit:
                raise ConfigError(f"max_model_len {wanted} exceeds the model's max_position_embeddings {limit}")
            if wanted > capacity_tokens:
                raise ConfigError(f"max_model_len {wanted} exceeds the KV cache capacity of {capacity_tokens} "
                                  "tokens; raise num_kv_blocks / kv_cache_memory_bytes or lower max_model_len")
            return wanted
        if capacity_tokens < limit:
            log.info("max_model_len limited by the KV cache to %d tokens", capacity_tokens)
        return min(limit, capacity_tokens)

    # ---- requests ------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | Sequence[int], params: SamplingParams | None = None, *,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                    deadline: float | None = None) -> Request:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, [int(t) for t in prompt]
        self._validate_prompt(token_ids)
        req = Request(request_id, token_ids, params, arrival_time=arrival_time, priority=priority,
                      cache_salt=cache_salt, prompt=text, deadline=deadline,
                      eos_token_ids=frozenset(self.arch.eos_token_ids) | self.tokenizer.eos_token_ids)
        if params.seed is not None:
            self._generators[request_id] = torch.Generator(device=self.device).manual_seed(params.seed)
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestError("the prompt is empty")
        vocab = self.arch.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        if len(token_ids) >= self.max_model_len:
            raise RequestError(f"prompt has {len(token_ids)} tokens; the context limit is {self.max_model_len} "
                               "(prompt + at least one generated token)")
        sc = self.config.scheduler
        if not sc.enable_chunked_prefill and len(token_ids) > sc.max_num_batched_tokens:
            raise RequestError(f"prompt has {len(token_ids)} tokens, more than max_num_batched_tokens "
                               f"({sc.max_num_batched_tokens}) with chunked prefill disabled")

    def abort_request(self, request_id: str, status: RequestStatus = S.CANCELLED) -> bool:
        """Cancel / time out / fail a live request. Idempotent: False when it had already ended."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        reason = {S.CANCELLED: FinishReason.ABORT, S.TIMED_OUT: FinishReason.TIMEOUT,
                  S.FAILED: FinishReason.ERROR}[status]
        return self._reclaim(req, status, reason)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the tick ------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._expire_deadlines()
        out = self.scheduler.schedule()
        now = time.monotonic()
        for req, _ in out.scheduled:
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
        outputs: list[RequestOutput] = []
        if not out.is_empty:
            tables = [self.kv.block_table(r) for r, _ in out.scheduled]
            batch = self.runner.build_batch(out.scheduled, tables)
            logits = self.runner.execute(batch)
            self.scheduler.update_after_step(out)
            self.num_steps += 1
            if batch.sampling_requests:
                reqs = batch.sampling_requests
                tokens = self.sampler.sample(logits, [r.params for r in reqs],
                                             [self._generators.get(r.request_id) for r in reqs]).tolist()
                emit = time.monotonic()
                for req, tok in zip(reqs, tokens, strict=True):
                    self._append_token(req, tok, emit)
                    outputs.append(self._make_output(req))
        outputs.extend(self._finished_outputs)
        self._finished_outputs = []
        return outputs

    def _append_token(self, req: Request, token: int, now: float) -> None:
        req.append_output_token(token)
        if req.times.first_token is None:
            req.times.first_token = now
        req.times.last_token = now
        req.times.token_times.append(now)
        if req.status is S.PREFILL:
            req.transition(S.DECODE)
        reason = self._stop_reason(req, token)
        if reason is not None:
            self._reclaim(req, S.FINISHED, reason, emit_output=False)

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = None
                return FinishReason.STOP
            if token in p.stop_token_ids:
                req.stop_reason = token
                return FinishReason.STOP
        if p.max_tokens is not None and req.num_output_tokens >= p.max_tokens:
            return FinishReason.LENGTH
        if req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _expire_deadlines(self) -> None:
        now = time.monotonic()
        for req in [r for r in self.requests.values() if r.deadline is not None and now >= r.deadline]:
            self._reclaim(req, S.TIMED_OUT, FinishReason.TIMEOUT)

    # ---- the one reclaim routine ---------------------------------------------------------------------
    def _reclaim(self, req: Request, status: RequestStatus, reason: FinishReason, emit_output: bool = True) -> bool:
        """Every terminal state goes through here. Idempotent: a second call (cancel racing a timeout) is a
        no-op. Releases blocks by reference count, rolls back a queued request's reservation, frees its
        batch slot, and writes exactly one terminal record."""
        if req.is_finished or self.requests.get(req.request_id) is not req:
            return False
        req.transition(status)
        req.finish_reason = reason
        req.times.finished = time.monotonic()
        self.scheduler.remove(req)
        self.kv.forget(req)
        self._generators.pop(req.request_id, None)
        del self.requests[req.request_id]
        n = req.num_output_tokens
        self.terminal_records.append(TerminalRecord(
            request_id=req.request_id, status=status.value, finish_reason=reason.value, num_generated=n,
            num_emitted=n, num_committed=n, num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
            timings={"arrival": req.times.arrival, "first_scheduled": req.times.first_scheduled,
                     "first_token": req.times.first_token, "finished": req.times.finished}))
        if emit_output:
            self._finished_outputs.append(self._make_output(req))
        return True

    def _make_output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        text = self.tokenizer.decode(req.output_token_ids) if finished else ""
        completion = CompletionOutput(index=0, text=text, token_ids=list(req.output_token_ids),
                                      finish_reason=req.finish_reason.value if req.finish_reason else None,
                                      stop_reason=req.stop_reason)
        t = req.times
        metrics = RequestMetrics(arrival_time=t.arrival, first_scheduled_time=t.first_scheduled,
                                 first_token_time=t.first_token, last_token_time=t.last_token,
                                 finished_time=t.finished)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             outputs=[completion], finished=finished, num_cached_tokens=req.num_cached_tokens,
                             metrics=metrics)

    # ---- introspection -------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        self.kv.check_invariants()
        live = set(self.requests)
        assert set(self.kv.tables) <= live, "a finished request still holds a block table"
