"""Preallocated per-layer K/V tensors on the device, and the host swap space for preempted requests.

Layout per layer, for K and for V, as the attention backend asks (see ``attention/metadata.py``): "NHD"
``[num_blocks, block_size, num_kv_heads, head_dim]`` or "HND" ``[num_blocks, num_kv_heads, block_size,
head_dim]``. Dimension 0 is always the block, so block copies and swaps do not depend on the layout.
Tensors start zeroed: padded key positions are masked, but a masked NaN would still poison softmax·V.
"""

from __future__ import annotations

import torch

from kvpilot.engine.kv.capacity import kv_bytes_per_token


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        layout: str = "NHD",
    ) -> None:
        if layout not in ("NHD", "HND"):
            raise ValueError(f"KV cache layout must be 'NHD' or 'HND', got {layout!r}")
        shape = (
            (num_blocks, block_size, num_kv_heads, head_dim)
            if layout == "NHD"
            else (num_blocks, num_kv_heads, block_size, head_dim)
        )
        self.layout = layout
        self.num_blocks, self.block_size = num_blocks, block_size
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)
        ]
        self.bytes_per_token = kv_bytes_per_token(num_layers, num_kv_heads, head_dim, dtype.itemsize)

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks ``src[i]`` → ``dst[i]`` in every layer (copy-on-write of shared blocks)."""
        s = torch.tensor(src, device=self.layers[0][0].device)
        d = torch.tensor(dst, device=self.layers[0][0].device)
        for k, v in self.layers:
            k.index_copy_(0, d, k.index_select(0, s))
            v.index_copy_(0, d, v.index_select(0, s))


class HostSwapSpace:
    """Host-memory blocks that hold swapped-out KV; blocks are handed out from a simple free list."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        k0 = cache.layers[0][0]
        shape = (num_blocks, *k0.shape[1:])
        pin = k0.device.type == "cuda"
        self.cache = cache
        self.layers = [
            (
                torch.zeros(shape, dtype=k0.dtype, pin_memory=pin),
                torch.zeros(shape, dtype=k0.dtype, pin_memory=pin),
            )
            for _ in cache.layers
        ]
        self._free = list(range(num_blocks))
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def swap_out(self, device_blocks: list[int]) -> list[int]:
        if len(device_blocks) > len(self._free):
            raise RuntimeError(f"swap space full: need {len(device_blocks)} blocks, {len(self._free)} free")
        host = [self._free.pop() for _ in device_blocks]
        self.copy_out(device_blocks, host)
        return host

    def swap_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        self.copy_in(host_blocks, device_blocks)
        self.release(host_blocks)

    def copy_out(self, device_blocks: list[int], host_blocks: list[int]) -> None:
        """Device blocks → the given host blocks, every layer (a tensor-parallel worker replays rank 0's
        choice of host blocks through it)."""
        src = torch.tensor(device_blocks, device=self.cache.layers[0][0].device)
        dst = torch.tensor(host_blocks)
        for (dk, dv), (hk, hv) in zip(self.cache.layers, self.layers, strict=True):
            hk.index_copy_(0, dst, dk.index_select(0, src).cpu())
            hv.index_copy_(0, dst, dv.index_select(0, src).cpu())

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Host blocks → device blocks, every layer; the host blocks stay allocated."""
        src = torch.tensor(host_blocks)
        dst = torch.tensor(device_blocks, device=self.cache.layers[0][0].device)
        for (dk, dv), (hk, hv) in zip(self.cache.layers, self.layers, strict=True):
            dk.index_copy_(0, dst, hk.index_select(0, src).to(dk.device, non_blocking=True))
            dv.index_copy_(0, dst, hv.index_select(0, src).to(dv.device, non_blocking=True))

    def release(self, host_blocks: list[int]) -> None:
        self._free.extend(host_blocks)
