"""kvpilot.engine.native — fused float32 CPU kernels in C, for the CPU decode/prefill hot loop (the KV
cache may hold fp8/int8 codes instead, docs/architecture.md#kv-cache-dtype).

Package map:
- ``vec.h``              shared inline helpers: a vectorizable exp (AVX2), dot products, lane reductions,
                         the 6 x 16 register tile of the GEMM-shaped kernels
- ``elementwise.c``      RMSNorm with the residual add fused in, RoPE in place, SiLU-and-multiply
- ``kv_codes.h``         the KV cache's element formats (``kv_cache_dtype``): fp8 e4m3 codes (a 256-entry
                         table to read, bit operations to write) and int8 codes, with per-tensor or
                         per-row scales
- ``kv_write.c``         the K/V scatter into the paged (HND) cache, as values or codes (+ row scales)
- ``decode_attention.c`` paged decode attention reading K/V blocks in place with an online softmax
- ``prefill_attention.c`` causal attention of prefill/extend tokens over the paged cache: tiles of 24 query
                         rows, register-blocked score and value products, an online softmax (flash style)
- ``small_gemm.c``       the GEMM of decode-sized batches (the engine: up to 256 rows) on weights packed in
                         16-column panels (a 6 x 16 register tile)
- ``quant_blocks.h``     the quantized formats' blocks: scales, scalar and in-register dequantization
                         (AVX2, or AVX-512 where the compiler targets it)
- ``quant_gemm.c``       the GEMM on quantized weights (GGUF Q4_0 / Q4_1 / Q8_0 blocks, Q4_K / Q6_K
                         super-blocks, int8 rows): dot products for up to 4 rows, dequantized L1 slabs
                         beyond; dequantization to float32
- ``quant_ops``          ``QuantKernels`` (``NativeOps.quant``): the quantized formats' table and the
                         validating wrappers of ``quant_gemm.c``
- ``quant_tiles.h``     the int8-activation GEMM's packed weight layout (16-row tiles of 32-input blocks)
- ``quant_vnni.c``       the int8-activation GEMM (AVX-512 VNNI, llama.cpp's scheme): Q4_0 / Q4_1 / Q4_K /
                         Q8_0 / int8 weights repacked into 16-row tiles, activations rounded per 32 inputs
- ``quant_vnni_avx2.c``  the same GEMM on AVX2 without VNNI (maddubs + madd, as llama.cpp's AVX2 kernels)
- ``vnni_ops``           ``VnniKernels`` (``NativeOps.vnni``): packing, the GEMM and the activation rounding
- ``kernels.h``          prototypes of the exported kernels other kernels call (their files include it too)
- ``decode_step.c``      a decode step's decoder layers in one call: the kernels above in the fused-C path's
                         order on preallocated buffers (split projections: parts side by side, then bias)
- ``decode_step_ops``    ``DecodeStepKernels`` (``NativeOps.decode_step``): ctypes mirror of its structs
- ``sampling.c``         the sampler's temperature, min-p, top-k, top-p and inverse-CDF draw, one row at a
                         time (a heap of the first k tokens, not a sort of the vocabulary)
- ``sampling_ops``       ``SamplingKernels`` (``NativeOps.sampling``): the validating wrapper of
                         ``sampling.c``
- ``build``              compiles the sources once per host (``-O3 -march=native``, plus any extra flags:
                         tests build the portable fallbacks with ``-mno-avx2``) into one library in the
                         cache directory, loads it with ctypes; ``NativeBuildError`` when that fails
- ``ops``                ``NativeOps``: tensor wrappers that validate dtype/layout before calling C (norm,
                         RoPE, K/V write, gated activations, the decode GEMM) and the kernel families below
- ``paged_attention_ops`` ``PagedAttentionKernels`` (``NativeOps.attention``): paged decode and prefill
                         attention, with the block-table and GQA checks
- ``tensor_checks``      the input checks every wrapper shares (float rows, contiguous arrays)
- ``kv_args``            the checks and C arguments of a float32, fp8 or int8 KV cache and its scales
- ``reference``          the PyTorch reference each kernel is tested against

Conventions of the C side: row-major float32 (quantized weights: their stored bytes, ``quant_ops``);
every "stride" counts elements between consecutive tokens, so q/k/v may be column slices of one fused qkv
row; the KV cache is head-major inside a block ("HND":
``[num_blocks, num_kv_heads, block_size, head_dim]``); OpenMP splits work over tokens (or sequence × KV
head, or weight panels) with the thread count the caller passes (torch's). Compiled with ``-ffast-math``
(vector exp, reassociated sums) but linked without it, so flush-to-zero is never switched on for the
whole process.

Used by the model (``kvpilot.engine.model.llama``), its oneDNN linears (small batches) and the torch
attention backend when the engine runs float32 on CPU with ``native_cpu_ops`` on (``auto``: when the
build succeeds).
"""
