"""The tensor-parallel process groups of one engine (docs/architecture.md#tensor-parallelism).

Two groups over one ``TCPStore`` rendezvous, as vLLM keeps them:

- the **control** group (gloo, CPU tensors): rank 0 broadcasts each step's inputs over it. Its timeout is
  long, because a worker waits in it while the engine is idle; rank 0's sends carry their own timeout (a
  worker that is alive but stopped never receives), and a dead peer breaks its TCP connection, which gloo
  reports at once.
- the **model** group (NCCL on CUDA, gloo on CPU): the all-reduces of the row-parallel layers and the
  logits gather, with a short timeout: a collective that does not complete in ``collective_timeout_s``
  raises instead of hanging the engine.

The groups are process-group objects, not torch's global default group, so several engines (a tp=1 and a
tp=2 one in one test process) never share state.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterator
from typing import Protocol, cast

import torch
import torch.distributed as dist

#: the host workers and rank 0 meet on: every rank runs on this node (multi-node is refused)
RENDEZVOUS_HOST = "127.0.0.1"
#: how long a worker waits for the next step (an idle engine) before giving up on rank 0
CONTROL_TIMEOUT_S = 7 * 24 * 3600.0


class Collectives(Protocol):
    """What a group is used for here. The groups are the gloo and NCCL backends themselves
    (``ProcessGroupGloo``, ``ProcessGroupNCCL``: a ``Backend``, not a ``ProcessGroup``), whose bindings
    have these collectives; torch's stub of ``Backend`` leaves them out."""

    def allreduce(self, tensors: list[torch.Tensor]) -> dist.Work: ...

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> dist.Work: ...

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work: ...

    def shutdown(self) -> None: ...


class TensorParallelGroup:
    """Rank ``rank`` of ``size``'s view of the two groups; rank 0 hosts the store (``port`` 0 = any free)."""

    def __init__(
        self,
        rank: int,
        size: int,
        port: int,
        device: torch.device,
        collective_timeout_s: float,
        store_timeout_s: float,
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.collective_timeout_s = collective_timeout_s
        self.store = dist.TCPStore(
            RENDEZVOUS_HOST,
            port,
            size,
            is_master=rank == 0,
            timeout=datetime.timedelta(seconds=store_timeout_s),
            wait_for_workers=False,
        )
        self.port = self.store.port
        self._control: Collectives | None = None
        self._model: Collectives | None = None
        #: collectives are skipped (each rank computes its own shard alone): the memory profile of rank 0
        self._local_only = False

    def connect(self) -> None:
        """Join both groups; blocks until every rank has joined (or the store timeout passes)."""
        short = datetime.timedelta(seconds=self.collective_timeout_s)
        long = datetime.timedelta(seconds=CONTROL_TIMEOUT_S)
        # cast: the backends' collectives are missing from torch's stub only (see ``Collectives``)
        self._control = cast(
            Collectives,
            dist.ProcessGroupGloo(dist.PrefixStore("control", self.store), self.rank, self.size, long),
        )
        model_store = dist.PrefixStore("model", self.store)
        if self.device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = short
            self._model = cast(Collectives, dist.ProcessGroupNCCL(model_store, self.rank, self.size, opts))
        else:
            self._model = cast(Collectives, dist.ProcessGroupGloo(model_store, self.rank, self.size, short))

    @property
    def model_group(self) -> Collectives:
        assert self._model is not None, "connect() first"
        return self._model

    @property
    def control_group(self) -> Collectives:
        assert self._control is not None, "connect() first"
        return self._control

    @contextlib.contextmanager
    def local_only(self) -> Iterator[None]:
        """Within it the collectives are skipped: rank 0 profiles a step's memory alone (its shard's
        activations are every rank's), without the workers."""
        self._local_only = True
        try:
            yield
        finally:
            self._local_only = False

    # ---- the model group ---------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; returns it."""
        if not self._local_only:
            self.model_group.allreduce([tensor]).wait(datetime.timedelta(seconds=self.collective_timeout_s))
        return tensor

    def gather_columns(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: every rank's ``[rows, n]`` shard side by side (``[rows, size * n]``); others: None."""
        if self._local_only:
            return tensor
        tensor = tensor.contiguous()
        opts = dist.GatherOptions()
        opts.rootRank = 0
        outputs = [[torch.empty_like(tensor) for _ in range(self.size)]] if self.rank == 0 else []
        work = self.model_group.gather(outputs, [tensor], opts)
        work.wait(datetime.timedelta(seconds=self.collective_timeout_s))
        return torch.cat(outputs[0], dim=1) if self.rank == 0 else None

    # ---- the control group -------------------------------------------------------------------------
    def broadcast_control(self, tensor: torch.Tensor, timeout_s: float | None = None) -> None:
        """Rank 0's CPU ``tensor`` into every rank's (same shape and dtype), in place. ``timeout_s`` bounds
        rank 0's send (a stopped worker never receives); a worker waits as long as the group allows."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if timeout_s is not None:
            opts.timeout = datetime.timedelta(seconds=timeout_s)
        self.control_group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the groups (their sockets close; a peer still waiting in one gets an error)."""
        for group in (self._model, self._control):
            if group is not None:
                with contextlib.suppress(Exception):
                    group.shutdown()
        self._model = self._control = None
