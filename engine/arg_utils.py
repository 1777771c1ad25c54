"""Engine-arg CLI flags with vLLM's names, shared by ``kvpilot generate`` and ``kvpilot serve``."""

from __future__ import annotations

import argparse
from typing import Any

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
    ConfigError,
    EngineConfig,
)
from kvpilot.engine.engine_args import EngineArgs

_BOOL_FLAGS = ("enable_prefix_caching", "enable_chunked_prefill")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineArgs()
    g = parser.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=d.model,
        help="smollm2-135m (bundled, default), tiny-random, a .gguf path or an HF safetensors directory",
    )
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="auto = float32 on CPU, bfloat16 on CUDA")
    g.add_argument(
        "--quantization",
        "-q",
        default=d.quantization,
        help=f"weights kept quantized, one of {', '.join(QUANTIZATIONS)}: auto keeps a GGUF's blocks "
        "(Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) where the CPU kernels run them; int8 quantizes any float model "
        "at load",
    )
    g.add_argument(
        "--activation-quantization",
        default=d.activation_quantization,
        choices=ACTIVATION_QUANTIZATIONS,
        help="activations of the quantized GEMMs: auto = int8 for gguf/int8 weights (rounded per 32 "
        "inputs, as llama.cpp does) where the CPU has AVX-512 VNNI or AVX2, else none (the weights' exact "
        "products); fp8 = W8A8 for fp8 weights on the Triton GEMM (e4m3 rows, fp8 tensor cores)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="context limit in tokens (default: the model's, capped by KV capacity)",
    )
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or cuda:N")
    g.add_argument("--download-dir", default=d.download_dir, help="cache for converted weights")
    g.add_argument("--seed", type=int, default=d.seed, help="engine RNG seed for unseeded requests")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--num-gpu-blocks-override",
        "--num-kv-blocks",
        dest="num_kv_blocks",
        type=int,
        default=d.num_kv_blocks,
        help="exact number of KV blocks (overrides the memory budget)",
    )
    g.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=d.kv_cache_memory_bytes,
        help="KV cache budget in bytes (default: 1 GiB on CPU, --gpu-memory-utilization on CUDA)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction of the GPU's memory for this engine: the KV cache gets what the weights and "
        "one profiled step of --max-num-batched-tokens leave (default: %(default)s)",
    )
    g.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=d.enable_prefix_caching
    )
    g.add_argument("--swap-space", type=float, default=d.swap_space, help="GiB of host memory for swapped KV")
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        help=f"KV cache element, one of {', '.join(KV_CACHE_DTYPES)}: auto = the model's dtype; fp8 (e4m3) "
        "and int8 store one byte per element with a scale per token and KV head (fp8: the checkpoint's "
        "per-layer k_scale/v_scale when it has them)",
    )
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most sequences per step")
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget per step (prefill chunks + decodes)",
    )
    g.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=d.enable_chunked_prefill
    )
    g.add_argument("--preemption-mode", default=d.preemption_mode, choices=PREEMPTION_MODES)
    g.add_argument("--batching-mode", default=d.batching_mode, choices=BATCHING_MODES)
    g.add_argument(
        "--reserved-output-fraction",
        type=float,
        default=d.reserved_output_fraction,
        help="share of each request's output budget kept free in the KV cache before another "
        "request starts (0: as vLLM; 1: no preemption for requests that start)",
    )
    g.add_argument("--attention-backend", default=d.attention_backend, choices=ATTENTION_BACKENDS)
    g.add_argument(
        "--linear-backend",
        default=d.linear_backend,
        choices=LINEAR_BACKENDS,
        help="auto = oneDNN-packed weights for float32 on CPU, triton on CUDA (the GEMMs of quantized "
        "weights, quantization gguf/int8, in the Triton kernel on their blocks)",
    )
    g.add_argument(
        "--native-cpu-ops",
        default=d.native_cpu_ops,
        choices=NATIVE_CPU_OPS,
        help="fused C kernels for float32 on CPU (auto = when a C compiler builds them)",
    )
    g.add_argument("--logprobs-mode", default=d.logprobs_mode, choices=LOGPROBS_MODES)
    g.add_argument("--max-logprobs", type=int, default=d.max_logprobs)
    g.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=d.tensor_parallel_size,
        help="split the model over this many processes (GPUs) of this node: NCCL on CUDA, gloo on CPU "
        "(default: %(default)s)",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=d.enforce_eager,
        help="never capture decode steps into CUDA graphs (graphs are used on CUDA with the triton "
        "attention backend)",
    )
    g.add_argument(
        "--cuda-graph-sizes",
        type=int,
        nargs="+",
        default=list(d.cuda_graph_sizes),
        help="decode batch sizes to capture as CUDA graphs (default: 1 2 4 then multiples of 8 up to "
        "--max-num-seqs, at most 512)",
    )
    g.add_argument(
        "--disable-async-output-proc",
        action="store_true",
        default=d.disable_async_output_proc,
        help="on CUDA: detokenize each step's tokens before the next step instead of during its forward",
    )
    g.add_argument(
        "--async-scheduling",
        action="store_true",
        default=d.async_scheduling,
        help="schedule each step before the previous step's tokens reach the host, so output processing "
        "overlaps the forward (pays on a GPU; not with speculative decoding or tensor parallelism)",
    )
    g.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding as JSON with vLLM\'s keys, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": '
        '"PATH", "num_speculative_tokens": 3}\'; "disable_by_batch_size" (default 4) switches it off for '
        "larger batches (default: off)",
    )


def engine_args_from_namespace(ns: argparse.Namespace, **overrides: Any) -> EngineArgs:
    names = list(EngineArgs.__dataclass_fields__)
    values = {n: getattr(ns, n) for n in names if hasattr(ns, n)}
    values.update(overrides)
    return EngineArgs.from_kwargs(**values)


def config_from_namespace(
    parser: argparse.ArgumentParser, ns: argparse.Namespace, **overrides: Any
) -> EngineConfig:
    """Validated ``EngineConfig``; an invalid argument exits with a CLI message (status 2), no traceback."""
    try:
        return engine_args_from_namespace(ns, **overrides).create_config()
    except ConfigError as err:
        parser.error(str(err))
