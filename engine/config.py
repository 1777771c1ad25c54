"""Engine configuration: one typed, documented dataclass per area (model, cache, scheduler, and the engine's
own fields), the accepted values of each choice, and ``ConfigError``.

They are filled once, from the flat vLLM-named arguments of ``EngineArgs`` (``engine/engine_args.py``),
which check every field first; the engine reads only these.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpilot.engine.spec_decode.config import SpeculativeConfig

DTYPES = ("auto", "float32", "float16", "bfloat16")
PREEMPTION_MODES = ("recompute", "swap")
BATCHING_MODES = ("continuous", "static")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
LINEAR_BACKENDS = ("auto", "torch", "onednn", "triton")
NATIVE_CPU_OPS = ("auto", "on", "off")
#: weight quantization (docs/architecture.md#quantized-weights): ``auto`` keeps a GGUF's blocks where the
#: engine runs them and an fp8 checkpoint's e4m3 weights on CUDA; ``none``; ``gguf``; ``int8`` (weight-only,
#: per output row, quantized at load); ``fp8`` (e4m3 weights on CUDA)
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "fp8")
#: KV cache element (docs/architecture.md#kv-cache-dtype): ``auto`` = the model's dtype; ``fp8`` = e4m3 codes
#: with the checkpoint's per-layer k/v scales, else a float32 scale per (token, KV head); ``int8`` = int8
#: codes with a float32 scale per (token, KV head)
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
#: activations of the quantized weights' GEMMs (docs/architecture.md#quantized-weights): ``auto`` = int8
#: for gguf/int8 weights where the CPU has AVX-512 VNNI or AVX2, else none; ``int8`` (rounded per 32 inputs,
#: llama.cpp's CPU scheme; fails without either); ``fp8`` (W8A8: fp8 weights' Triton GEMM rounds each row to
#: e4m3, fp8 tensor cores); ``none`` (the activations' dtype: the weights' exact products)
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int8", "fp8")
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: ~23k tokens of SmolLM2 in fp32


class ConfigError(ValueError):
    """An engine argument is invalid; the message names the argument and the accepted values."""


@dataclass(frozen=True)
class ModelConfig:
    #: model name (``smollm2-135m``, ``tiny-random``), a ``.gguf`` path, or an HF safetensors directory
    model: str
    #: weights/activations dtype; ``auto`` = float32 on CPU, bfloat16 on CUDA
    dtype: str = "auto"
    #: context limit in tokens (prompt + output); None = the model's ``max_position_embeddings``
    max_model_len: int | None = None
    #: ``cpu``, ``cuda``, ``cuda:N`` or ``auto`` (CUDA when available)
    device: str = "auto"
    #: where converted GGUF weights are cached; None = ``$KVPILOT_CACHE_DIR`` or ``~/.cache/kvpilot``
    download_dir: str | None = None
    #: seed of the engine's RNG for requests without their own ``seed``
    seed: int = 0
    #: name reported in outputs and metrics; None = the ``model`` string
    served_model_name: str | None = None
    #: weights kept quantized (``QUANTIZATIONS``): ``auto`` = a GGUF's own blocks where the kernels run
    #: them (float32 on CPU), else float weights in ``dtype``
    quantization: str = "auto"
    #: activations of the quantized GEMMs (``ACTIVATION_QUANTIZATIONS``): ``auto`` = ``int8`` for
    #: ``gguf`` / ``int8`` weights where the CPU has AVX-512 VNNI or AVX2 (about 1.4-2x faster decode;
    #: results move by the rounding), else ``none``; ``fp8`` = W8A8 for ``fp8`` weights on the Triton GEMM
    activation_quantization: str = "auto"


@dataclass(frozen=True)
class CacheConfig:
    #: tokens per KV block
    block_size: int = 16
    #: explicit number of KV blocks (block 0 included, it stays reserved); overrides the memory budget
    num_kv_blocks: int | None = None
    #: KV cache budget in bytes; None = 1 GiB on CPU, on CUDA what ``gpu_memory_utilization`` leaves after
    #: the weights and a profiled step (``memory_profile``)
    kv_cache_memory_bytes: int | None = None
    #: fraction of the device's total memory this engine may use on CUDA (weights, activations, KV cache)
    gpu_memory_utilization: float = 0.9
    #: reuse KV of identical token prefixes across requests (hash chain of full blocks)
    enable_prefix_caching: bool = True
    #: host memory (GiB) for swapped-out KV when ``preemption_mode`` is ``swap``
    swap_space: float = 0.0
    #: what the KV cache stores (``KV_CACHE_DTYPES``): ``auto`` = the model's dtype, ``fp8`` (e4m3) or
    #: ``int8``: one byte per element (+ 4 per token and KV head row of scales), so about 3.8x (fp32) or
    #: 1.9x (bf16) the blocks in the same memory at head_dim 64
    kv_cache_dtype: str = "auto"


@dataclass(frozen=True)
class SchedulerConfig:
    #: most sequences in one step's batch
    max_num_seqs: int = 64
    #: token budget of one step (prefill chunks + one token per decode)
    max_num_batched_tokens: int = 2048
    #: split long prompts across steps so decodes keep flowing
    enable_chunked_prefill: bool = True
    #: what a preempted request loses: ``recompute`` frees its blocks, ``swap`` moves them to host memory
    preemption_mode: str = "recompute"
    #: ``continuous`` refills free batch slots every step; ``static`` admits a new batch only when the
    #: whole previous one has finished (a baseline for comparisons, docs/architecture.md#scheduling)
    batching_mode: str = "continuous"
    #: share of each request's output budget (``max_tokens``, else the context left) whose KV blocks must
    #: stay free, for it and for every running request, before a waiting request is started: 0 = start
    #: whatever fits its prompt now (vLLM's policy: most concurrency, preemption when outputs grow), 1 =
    #: start only what can finish without preemption
    reserved_output_fraction: float = 0.0


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    #: ``auto`` (triton on CUDA, torch on CPU), ``torch`` or ``triton``
    attention_backend: str = "auto"
    #: GEMMs of the decoder layers: ``auto`` (oneDNN-packed weights for float32 on CPU, triton on CUDA,
    #: torch otherwise), ``torch`` (plain ``F.linear``), ``onednn``, or ``triton`` (quantized weights'
    #: GEMMs in the Triton kernel on their blocks, float ones ``F.linear``; on CPU only in Triton's
    #: interpreter, ``TRITON_INTERPRET=1``)
    linear_backend: str = "auto"
    #: fused C kernels for float32 on CPU (RMSNorm+residual, RoPE, K/V write, SiLU-mul, paged decode
    #: attention, and with oneDNN linears the GEMM of steps up to 256 rows; compiled once per host into the
    #: cache directory): ``auto`` (use them when a C compiler builds them, else PyTorch ops with a
    #: warning), ``on`` (fail if they cannot be built) or ``off``
    native_cpu_ops: str = "auto"
    #: what ``logprobs`` report: the model's raw distribution or the one the sampler drew from
    logprobs_mode: str = "raw_logprobs"
    #: most logprobs a request may ask for
    max_logprobs: int = 20
    #: speculative decoding (docs/architecture.md#speculative-decoding); None = off
    speculative_config: SpeculativeConfig | None = None
    #: ranks the model is split over on this node, one process (and GPU) each; 1 = no tensor parallelism
    #: (docs/architecture.md#tensor-parallelism)
    tensor_parallel_size: int = 1
    #: never capture decode steps into CUDA graphs (vLLM's flag): every step runs its kernels one launch at
    #: a time. Graphs are used on CUDA with the Triton attention backend, one process, otherwise never
    #: (docs/architecture.md#captured-decode)
    enforce_eager: bool = False
    #: the decode batch sizes captured as CUDA graphs (each in 1..max_num_seqs); empty = 1, 2, 4, then
    #: every multiple of 8 up to max_num_seqs (at most 512, and max_num_seqs itself). A decode step of n
    #: sequences replays the smallest size >= n; one larger than every size runs eagerly
    cuda_graph_sizes: tuple[int, ...] = ()
    #: detokenize and check stop strings in the step that samples a token, not during the next step's
    #: forward (vLLM's flag). Asynchronous output processing runs on CUDA only, where the host waits on the
    #: device (docs/architecture.md#asynchronous-output-processing)
    disable_async_output_proc: bool = False
    #: schedule and launch each step before the host has the previous step's sampled tokens (vLLM's
    #: flag): the step reads them on the device, and the host appends them, with every stop check, while
    #: it computes. A sequence that stops computes one row more, dropped; steps with logprobs or beams
    #: sample synchronously. Not with speculative decoding or tensor parallelism
    #: (docs/architecture.md#asynchronous-scheduling)
    async_scheduling: bool = False
