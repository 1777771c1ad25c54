"""Triton kernels for paged attention, one kernel per module.

- ``kv_codes``   fp8/int8 KV codes (``kv_cache_dtype``): bit-exact e4m3 decode/encode, int8 rounding, and
                 the host-side arguments that describe a cache and its scales to the kernels
- ``tile_ops``   device functions the attention kernels share: paged K/V tile gather (dequantizing codes),
                 dot, online softmax
- ``kv_write``   scatter each step's new K/V into their cache slots (as codes and scales when quantized)
- ``decode``     paged decode attention (one query token per sequence, GQA-aware, split-KV)
- ``split_kv``   how many KV splits a decode launch uses, and the kernel that merges the split results
- ``prefill``    varlen prefill/extend attention over a cached paged prefix plus the new tokens
- ``launch_math`` host-side grid and block-size arithmetic as plain integers (Triton's helpers cost µs
                 a call)
- ``tuning``     launch configurations and the warm-up tuner that picks them per served shape
- ``reference``  plain PyTorch references the kernels are tested against
- ``synthetic``  random paged batches (shuffled blocks, NaN in unused slots) for kernel tests and benchmarks
- ``warmup``     times the candidate launch configurations on the served shapes before the engine is ready

This package imports no kernel module itself: whether Triton compiles a kernel or runs it in the
interpreter is decided when the kernel module is imported (``TRITON_INTERPRET``), so
``kvpilot.engine.attention.triton_loader.load_kernels`` controls that import.
"""
