"""``EngineArgs``: the flat, user-facing engine arguments with vLLM's names (the offline ``LLM(**kwargs)`` and
``kvpilot serve`` flags map onto them one-to-one), each checked once with a clear ``ConfigError`` and turned
into the typed per-area configs of ``engine/config.py`` by ``create_config()``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypeVar

from kvpilot.engine.config import (
    ACTIVATION_QUANTIZATIONS,
    ATTENTION_BACKENDS,
    BATCHING_MODES,
    DTYPES,
    KV_CACHE_DTYPES,
    LINEAR_BACKENDS,
    LOGPROBS_MODES,
    NATIVE_CPU_OPS,
    PREEMPTION_MODES,
    QUANTIZATIONS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from kvpilot.engine.spec_decode.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

#: one of the per-area config dataclasses ``create_config`` fills from the flat arguments
_Area = TypeVar("_Area", bound="DataclassInstance")

#: vLLM method names kvpilot knows but does not run (yet), with what they need
_UNSUPPORTED_QUANTIZATIONS = {
    "awq": "AWQ int4 checkpoints are not supported yet (fp8 checkpoints and GGUF files are)",
    "gptq": "GPTQ int4 checkpoints are not supported yet (fp8 checkpoints and GGUF files are)",
}


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
