"""Engine configuration: vLLM-named engine args, validated once into typed per-area configs.

``EngineArgs`` is the flat, user-facing bag (the offline ``LLM(**kwargs)`` and ``kvpilot serve`` flags map
onto it one-to-one, with vLLM's names where vLLM has the concept). ``EngineArgs.create_config()`` checks
every field and returns an ``EngineConfig`` made of one dataclass per area.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from kvpilot.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: one of the per-area config dataclasses ``create_config`` fills from the flat arguments
_Area = TypeVar("_Area", bound="DataclassInstance")

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
#: vLLM method names kvpilot knows but does not run (yet), with what they need
_UNSUPPORTED_QUANTIZATIONS = {
    "awq": "AWQ int4 checkpoints are not supported yet (fp8 checkpoints and GGUF files are)",
    "gptq": "GPTQ int4 checkpoints are not supported yet (fp8 checkpoints and GGUF files are)",
}
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


@dataclass
class EngineArgs:
    """Flat engine arguments with vLLM's names: the union of the per-area configs' fields (same names and
    defaults; a test keeps them so). See the per-area configs for each field's meaning."""

    model: str = "smollm2-135m"
    dtype: str = "auto"
    max_model_len: int | None = None
    device: str = "auto"
    download_dir: str | None = None
    seed: int = 0
    served_model_name: str | None = None
    quantization: str = "auto"
    activation_quantization: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    swap_space: float = 0.0
    kv_cache_dtype: str = "auto"
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    batching_mode: str = "continuous"
    reserved_output_fraction: float = 0.0
    attention_backend: str = "auto"
    linear_backend: str = "auto"
    native_cpu_ops: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    max_logprobs: int = 20
    #: a JSON object (string or dict) with vLLM's keys, e.g. ``{"method": "ngram",
    #: "num_speculative_tokens": 4}``
    speculative_config: str | dict[str, Any] | SpeculativeConfig | None = None
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | list[int] = ()
    disable_async_output_proc: bool = False
    async_scheduling: bool = False

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine argument(s) {unknown}; valid: {sorted(names)}")
        return cls(**kwargs)

    def create_config(self) -> EngineConfig:
        self._validate()
        try:
            speculative = parse_speculative_config(self.speculative_config)
        except ValueError as err:
            raise ConfigError(str(err)) from None

        def pick(area: type[_Area]) -> _Area:
            return area(**{f.name: getattr(self, f.name) for f in fields(area)})

        top = {
            f.name: getattr(self, f.name)
            for f in fields(EngineConfig)
            if f.name not in ("model", "cache", "scheduler")
        }
        top["speculative_config"] = speculative
        top["cuda_graph_sizes"] = tuple(self.cuda_graph_sizes)
        if self.tensor_parallel_size > 1 and speculative is not None and speculative.method == "draft_model":
            raise ConfigError(
                "speculative_config method 'draft_model' with tensor_parallel_size > 1: the draft model is "
                "not split across ranks yet; use method 'ngram' or tensor_parallel_size=1"
            )
        if self.async_scheduling and (speculative is not None or self.tensor_parallel_size > 1):
            raise ConfigError(
                "async_scheduling does not run with speculative decoding or tensor_parallel_size > 1 yet: "
                "their steps need the last step's tokens on the host"
            )
        return EngineConfig(
            model=pick(ModelConfig), cache=pick(CacheConfig), scheduler=pick(SchedulerConfig), **top
        )

    def _validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(msg)

        need(isinstance(self.model, str) and bool(self.model), "model must be a non-empty string")
        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        self._validate_quantization()
        need(
            self.activation_quantization in ACTIVATION_QUANTIZATIONS,
            f"activation_quantization must be one of {ACTIVATION_QUANTIZATIONS}, "
            f"got {self.activation_quantization!r}",
        )
        need(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}",
        )
        need(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            f"block_size must be a power of two in [1, 128], got {self.block_size}",
        )
        need(
            self.num_kv_blocks is None or self.num_kv_blocks >= 2,
            f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}",
        )
        need(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )
        need(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        need(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        self._validate_kv_cache_dtype()
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(
            self.max_num_batched_tokens >= 1,
            f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}",
        )
        need(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}): every running sequence needs at least one token of each step's budget",
        )
        need(
            self.max_model_len is None or self.max_model_len >= 1,
            f"max_model_len must be >= 1, got {self.max_model_len}",
        )
        need(
            self.preemption_mode in PREEMPTION_MODES,
            f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}",
        )
        need(
            self.preemption_mode != "swap" or self.swap_space > 0,
            "preemption_mode='swap' needs swap_space > 0 (GiB of host memory for swapped KV)",
        )
        need(
            0.0 <= self.reserved_output_fraction <= 1.0,
            f"reserved_output_fraction must be in [0, 1], got {self.reserved_output_fraction}",
        )
        need(
            self.batching_mode in BATCHING_MODES,
            f"batching_mode must be one of {BATCHING_MODES}, got {self.batching_mode!r}",
        )
        need(
            self.attention_backend in ATTENTION_BACKENDS,
            f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}",
        )
        need(
            self.linear_backend in LINEAR_BACKENDS,
            f"linear_backend must be one of {LINEAR_BACKENDS}, got {self.linear_backend!r}",
        )
        need(
            self.native_cpu_ops in NATIVE_CPU_OPS,
            f"native_cpu_ops must be one of {NATIVE_CPU_OPS}, got {self.native_cpu_ops!r}",
        )
        need(
            self.logprobs_mode in LOGPROBS_MODES,
            f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}",
        )
        need(self.max_logprobs >= 0, f"max_logprobs must be >= 0, got {self.max_logprobs}")
        need(
            isinstance(self.tensor_parallel_size, int) and self.tensor_parallel_size >= 1,
            f"tensor_parallel_size must be an integer >= 1, got {self.tensor_parallel_size!r}",
        )
        sizes = self.cuda_graph_sizes
        need(
            isinstance(sizes, tuple | list)
            and all(
                isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.max_num_seqs for n in sizes
            ),
            f"cuda_graph_sizes must be batch sizes in 1..max_num_seqs={self.max_num_seqs}, got {sizes!r}",
        )

    def _validate_kv_cache_dtype(self) -> None:
        value = self.kv_cache_dtype
        if value in KV_CACHE_DTYPES:
            return
        hint = ""
        if isinstance(value, str) and value.startswith("fp8_"):
            hint = " (the fp8 KV cache is e4m3, vLLM's default 'fp8'; other fp8 formats are not supported)"
        raise ConfigError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {value!r}{hint}")

    def _validate_quantization(self) -> None:
        method = self.quantization
        if method == "fp8" and self.device == "cpu" and self.linear_backend != "triton":
            raise ConfigError(
                "quantization='fp8' needs a CUDA device (e4m3 weights run on GPUs; on CPU only the Triton "
                "interpreter runs them, linear_backend='triton'); on CPU use 'auto' (an fp8 checkpoint loads "
                "dequantized), 'none', 'gguf' or 'int8'"
            )
        if method in QUANTIZATIONS:
            return
        if method in _UNSUPPORTED_QUANTIZATIONS:
            raise ConfigError(
                f"quantization={method!r} is not available in this kvpilot: "
                f"{_UNSUPPORTED_QUANTIZATIONS[method]}; choices: {QUANTIZATIONS}"
            )
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {method!r}")
