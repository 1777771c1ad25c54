"""Rank 0's side of tensor parallelism: the worker processes and the step that drives them
(docs/architecture.md#tensor-parallelism).

``TensorParallelWorkers`` starts ranks 1..tp-1 (``torch.multiprocessing`` spawn), joins the groups with
them, and watches them: a watchdog thread waits on the processes' sentinels, so a worker that dies — at
start-up, between steps or inside a collective — is known at once and named. Every later step and
``check()`` raises ``TensorParallelError``; a collective that a dead or hung rank never completes raises
at its timeout. ``shutdown`` stops the workers (``STOP``, then SIGKILL for any that does not exit in
time) and joins them: no process outlives the engine.

``TensorParallelRunner`` is rank 0's ``ModelRunner``: before its own forward it broadcasts the step's
inputs and the KV operations recorded since the last step, so every rank runs the same forward.
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import wait
from typing import cast

import torch
import torch.multiprocessing as mp

from kvpilot.engine.config import ConfigError, EngineConfig
from kvpilot.engine.distributed.groups import TensorParallelGroup
from kvpilot.engine.distributed.sharding import TensorParallelRank, TensorShard, check_tensor_parallel
from kvpilot.engine.distributed.step_message import (
    ALLOCATE,
    STOP,
    KVOp,
    StepInputs,
    control_message,
    encode_step,
)
from kvpilot.engine.distributed.worker import WorkerSpec, worker_main
from kvpilot.engine.input_batch import InputBatch, StepBatch
from kvpilot.engine.kv.kv_cache import KVCache
from kvpilot.engine.model.arch import ModelArchConfig
from kvpilot.engine.model.llama import LlamaForCausalLM
from kvpilot.engine.model.registry import resolve_model
from kvpilot.engine.model_runner import ModelRunner

log = logging.getLogger(__name__)

#: how long a collective may take before the engine fails instead of hanging
COLLECTIVE_TIMEOUT_S = 60.0
#: how long rank 0 waits for every worker to join the groups (their start-up: importing torch)
STORE_TIMEOUT_S = 300.0
#: how long ``shutdown`` waits for a worker to exit after ``STOP`` before killing it
STOP_GRACE_S = 10.0
#: how long rank 0 waits for the workers to load their shards (the KV cache's sizes go out then)
LOAD_TIMEOUT_S = 1800.0


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed: the engine cannot compute another step."""


class TensorParallelWorkers:
    def __init__(self, config: EngineConfig, arch: ModelArchConfig, device: torch.device) -> None:
        size = config.tensor_parallel_size
        self.size = size
        self.group = TensorParallelGroup(0, size, 0, device, COLLECTIVE_TIMEOUT_S, STORE_TIMEOUT_S)
        spec = WorkerSpec(config, size, self.group.port, str(device), COLLECTIVE_TIMEOUT_S, STORE_TIMEOUT_S)
        ctx = mp.get_context("spawn")
        self.processes = [
            ctx.Process(target=worker_main, args=(rank, spec), name=f"kvpilot-tp-rank-{rank}", daemon=True)
            for rank in range(1, size)
        ]
        #: why the workers cannot serve (a dead rank, a failed collective); None while they can
        self.failure: str | None = None
        self._stopping = False
        self._lock = threading.Lock()
        for p in self.processes:
            p.start()
        self._watchdog = threading.Thread(target=self._watch, name="kvpilot-tp-watchdog", daemon=True)
        self._watchdog.start()
        try:
            self.group.connect()
        except Exception:
            self.shutdown()
            raise
        #: what rank 0's model load takes
        self.rank = TensorParallelRank(TensorShard(arch, 0, size), self.group)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def _watch(self) -> None:
        pending = {p.sentinel: p for p in self.processes}
        while pending:
            for sentinel in wait(list(pending)):
                # wait() returns the sentinels it was given (typeshed types them as any waitable)
                proc = pending.pop(cast(int, sentinel))
                proc.join()
                if not self._stopping:
                    self._fail(
                        f"tensor-parallel worker {proc.name} (pid {proc.pid}) exited with code "
                        f"{proc.exitcode}"
                    )

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = reason
                log.error("tensor parallelism failed: %s", reason)

    def check(self) -> None:
        """Raise ``TensorParallelError`` when a worker has died or a collective has failed."""
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def allocate(self, kv_cache: KVCache, swap_blocks: int) -> None:
        """Tell the workers the KV cache's block count (and swap blocks): they allocate theirs."""
        self.check()
        message = control_message(ALLOCATE, kv_cache.num_blocks, swap_blocks)
        self.group.broadcast_control(message, LOAD_TIMEOUT_S)

    def send(self, inputs: StepInputs) -> None:
        """Broadcast one step's inputs (one message; a payload too long for it sends its rest after)."""
        self.check()
        message, rest = encode_step(inputs)
        self.group.broadcast_control(message, self.group.collective_timeout_s)
        if rest is not None:
            self.group.broadcast_control(rest, self.group.collective_timeout_s)

    def fail(self, err: BaseException) -> TensorParallelError:
        """The error to raise for ``err`` from a collective; the workers are unusable from now on."""
        self._fail(self.failure or f"a collective failed: {type(err).__name__}: {err}")
        assert self.failure is not None
        return TensorParallelError(self.failure)

    def shutdown(self) -> None:
        """Stop every worker and wait for it (idempotent): STOP when all are alive, SIGKILL after
        ``STOP_GRACE_S`` otherwise."""
        if self._stopping:
            return
        self._stopping = True
        if self.failure is None and all(p.is_alive() for p in self.processes):
            try:
                self.group.broadcast_control(control_message(STOP), self.group.collective_timeout_s)
            except Exception as err:  # a worker died meanwhile: it is killed below
                log.warning("tensor-parallel STOP failed: %s", err)
        for p in self.processes:
            p.join(STOP_GRACE_S if self.failure is None else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
        self.group.close()


def start_workers(config: EngineConfig, device: torch.device) -> TensorParallelWorkers | None:
    """The workers of ``config.tensor_parallel_size`` > 1 ranks (None for 1), after checking that the
    model splits that way and the node has the devices."""
    size = config.tensor_parallel_size
    if size == 1:
        return None
    arch = ModelArchConfig.from_dir(resolve_model(config.model.model, cache_dir=config.model.download_dir))
    # the resolved quantization (``auto`` of a GGUF) is checked again when the shard loads
    check_tensor_parallel(arch, size, config.model.quantization)
    if device.type == "cuda":
        first = device.index or 0
        count = torch.cuda.device_count()
        if first + size > count:
            raise ConfigError(
                f"tensor_parallel_size={size} from {device} needs CUDA devices {first}..{first + size - 1}, "
                f"this node has {count}"
            )
    return TensorParallelWorkers(config, arch, device)


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: every step's inputs (and pending KV operations) go to the workers first."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        device: torch.device,
        input_batch: InputBatch,
        workers: TensorParallelWorkers,
        kv_ops: list[KVOp],
        vocab_size: int,
    ) -> None:
        super().__init__(model, kv_cache, device, input_batch)
        self.workers, self.kv_ops = workers, kv_ops
        self.vocab_size = vocab_size

    def execute(self, batch: StepBatch) -> torch.Tensor:
        meta = batch.meta
        inputs = StepInputs(
            batch.input_ids,
            batch.positions,
            meta.slot_mapping,
            batch.logits_indices,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            meta.num_decodes,
            list(self.kv_ops),
        )
        self.kv_ops.clear()
        try:
            self.workers.send(inputs)
            return super().execute(batch)
        except TensorParallelError:
            raise
        except RuntimeError as err:  # gloo/NCCL errors (DistBackendError is a RuntimeError)
            raise self.workers.fail(err) from err
