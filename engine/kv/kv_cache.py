"""Preallocated per-layer K/V tensors on the device, and the host swap space for preempted requests.

Layout per layer, for K and for V, as the attention backend asks (see ``attention/metadata.py``): "NHD"
``[num_blocks, block_size, num_kv_heads, head_dim]`` or "HND" ``[num_blocks, num_kv_heads, block_size,
head_dim]``. Dimension 0 is always the block, so block copies and swaps do not depend on the layout.
Tensors start zeroed: padded key positions are masked, but a masked NaN would still poison softmax·V.

A quantized cache (``kv_cache_dtype`` fp8/int8, docs/architecture.md#kv-cache-dtype) holds codes, and each
layer's ``LayerKV.quant`` their scales: fp8's per-tensor ``k_scale``/``v_scale`` from the checkpoint, or
(int8, and fp8 without them) a float32 scale per (slot, KV head) in tensors shaped like the cache without
its head_dim, which block copies and swaps move with the codes. fp8 tensors are copied through uint8
views (PyTorch has no fp8 ``index_copy`` on CPU).
"""

from __future__ import annotations

import torch

from kvpilot.engine.kv.capacity import kv_bytes_per_token
from kvpilot.engine.kv.kv_quant import KVQuant, LayerKV, as_bytes, scale_bytes_per_element_row, storage_dtype
from kvpilot.engine.staging import to_device


def _tensors(layer: LayerKV) -> list[torch.Tensor]:
    """Every per-block tensor of a layer: K and V codes, and int8's scales."""
    out = [as_bytes(layer.key), as_bytes(layer.value)]
    q = layer.quant
    if q is not None and q.key_scales is not None and q.value_scales is not None:
        out += [q.key_scales, q.value_scales]
    return out


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
        kv_cache_dtype: str = "auto",
        fp8_scales: list[tuple[float, float]] | None = None,
    ) -> None:
        """``dtype``: the model's (the cache's for ``kv_cache_dtype="auto"``); ``fp8_scales``: per layer
        ``(k_scale, v_scale)`` from the checkpoint (fp8 only; without them fp8 keeps a scale per row)."""
        if layout not in ("NHD", "HND"):
            raise ValueError(f"KV cache layout must be 'NHD' or 'HND', got {layout!r}")
        shape = (
            (num_blocks, block_size, num_kv_heads, head_dim)
            if layout == "NHD"
            else (num_blocks, num_kv_heads, block_size, head_dim)
        )
        if fp8_scales is not None and (kv_cache_dtype != "fp8" or len(fp8_scales) != num_layers):
            raise ValueError(
                f"fp8_scales needs kv_cache_dtype='fp8' and one (k, v) pair for each of {num_layers} layers"
            )
        self.layout = layout
        self.kv_cache_dtype = kv_cache_dtype
        self.num_blocks, self.block_size = num_blocks, block_size
        store = storage_dtype(kv_cache_dtype, dtype)
        self.layers: list[LayerKV] = []
        for i in range(num_layers):
            quant = None
            if kv_cache_dtype == "fp8" and fp8_scales is not None:
                quant = KVQuant("fp8", k_scale=fp8_scales[i][0], v_scale=fp8_scales[i][1])
            elif kv_cache_dtype in ("fp8", "int8"):  # scales per (slot, KV head)
                quant = KVQuant(
                    kv_cache_dtype,
                    key_scales=torch.zeros(shape[:-1], dtype=torch.float32, device=device),
                    value_scales=torch.zeros(shape[:-1], dtype=torch.float32, device=device),
                )
            self.layers.append(
                LayerKV(
                    torch.zeros(shape, dtype=store, device=device),
                    torch.zeros(shape, dtype=store, device=device),
                    quant,
                )
            )
        self.bytes_per_token = kv_bytes_per_token(
            num_layers,
            num_kv_heads,
            head_dim,
            store.itemsize,
            scale_bytes_per_element_row(kv_cache_dtype, fp8_scales is not None),
        )

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_blocks * self.block_size

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks ``src[i]`` → ``dst[i]`` in every layer (copy-on-write of shared blocks)."""
        device = self.layers[0].key.device
        s, d = to_device(src, torch.long, device), to_device(dst, torch.long, device)  # no wait for the queue
        for layer in self.layers:
            for t in _tensors(layer):
                t.index_copy_(0, d, t.index_select(0, s))


class HostSwapSpace:
    """Host-memory blocks that hold swapped-out KV; blocks are handed out from a simple free list. A block
    keeps the device cache's codes and int8 scales as they are (fp8 scales are per layer and stay put)."""

    def __init__(self, cache: KVCache, num_blocks: int) -> None:
        pin = cache.layers[0].key.device.type == "cuda"
        self.cache = cache
        self.layers = [
            [torch.zeros((num_blocks, *t.shape[1:]), dtype=t.dtype, pin_memory=pin) for t in _tensors(layer)]
            for layer in cache.layers
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
        src = to_device(device_blocks, torch.long, self.cache.layers[0].key.device)
        dst = torch.tensor(host_blocks)
        for layer, host_tensors in zip(self.cache.layers, self.layers, strict=True):
            for dev, hst in zip(_tensors(layer), host_tensors, strict=True):
                hst.index_copy_(0, dst, dev.index_select(0, src).cpu())  # the host needs the bytes: a wait

    def copy_in(self, host_blocks: list[int], device_blocks: list[int]) -> None:
        """Host blocks → device blocks, every layer; the host blocks stay allocated."""
        src = torch.tensor(host_blocks)
        device = self.cache.layers[0].key.device
        dst = to_device(device_blocks, torch.long, device)
        pin = device.type == "cuda"  # a gathered copy in pinned memory goes up without waiting for the queue
        for layer, host_tensors in zip(self.cache.layers, self.layers, strict=True):
            for dev, hst in zip(_tensors(layer), host_tensors, strict=True):
                rows = hst.index_select(0, src)
                dev.index_copy_(0, dst, (rows.pin_memory() if pin else rows).to(device, non_blocking=True))

    def release(self, host_blocks: list[int]) -> None:
        self._free.extend(host_blocks)
