"""kvpilot.engine — the paged-KV inference engine (how it fits together: docs/architecture.md).

Package map:

Configuration and entry points:
- ``config``             typed engine configuration (``EngineConfig``, one dataclass per area) and its choices
- ``engine_args``        ``EngineArgs``: the flat vLLM-named arguments, validated once into ``EngineConfig``
- ``arg_utils``          engine-arg CLI flags (vLLM's names), shared by ``kvpilot generate`` and ``serve``
- ``llm``                offline ``LLM`` API (vLLM-shaped)
- ``cli``                ``kvpilot generate``: offline generation from the command line
- ``server/``            OpenAI-compatible HTTP server (``kvpilot serve``)

Prompts and requests (``tokenizer``, ``prompt_render``, ``tool_prompt``, ``prompt_bound`` and ``tenancy``
are torch-free and shared with the router):
- ``tokenizer``          tokenizer + chat template
- ``prompt_render``      request body → prompt token ids, exactly as the server and the router derive them
- ``tool_prompt``        tools and tool messages in the prompt for templates that do not render them; the
                         model's tool-call format
- ``prompt_bound``       a lower bound on a text's token count without tokenizing it (refuses huge prompts)
- ``tenancy``            a request's tenant (``x-tenant``, else an API-key digest): the prefix-cache salt
- ``request_validation`` prompt and sampling checks against the loaded model (``RequestError``)
- ``request_intake``     a request's first sequence: tokenized, checked, bad words and grammar prepared
- ``sequence``           ``Sequence``: one sequence's state (tokens, progress, status) and the lifecycle
                         state machine (``SequenceStatus``)
- ``sequence_group``     ``SequenceGroup``: a user request and its sequences (parallel samples, beams);
                         builds its output
- ``beam_search``        beam selection over live sequences that share KV blocks
- ``detokenizer``        incremental detokenization and the stop-string hold-back buffer
- ``outputs``            ``RequestOutput`` / ``CompletionOutput`` and the terminal record every request leaves

The engine and its tick:
- ``engine_core``        ``LLMEngine``: add requests, ``step()`` (one scheduler tick), abort, invariants
- ``engine_setup``       start-up: a served model (weights, backend, quantization; target and draft), the
                         paged KV cache sized for it and the runner over it
- ``scheduler``          token-budget scheduler: continuous batching, chunked prefill, preemption
- ``model_runner``       builds the flattened batch of a tick and runs the model
- ``decode_graphs``      captured decode on CUDA: decode-only steps replay CUDA graphs at bucketed batch sizes
- ``input_batch``        the persistent batch: per-slot token ids and sampling parameters, each step's flat
                         inputs built from them
- ``staging``            host → device uploads through pinned staging buffers, non-blocking
- ``output_processor``   logits → tokens → outputs: sampling, verified drafts, beams
- ``token_appender``     appending a sampled token and its stop checks; asynchronous output processing
- ``in_flight``          asynchronous scheduling's sampled ids still on the device, and their copy to the host
- ``sequence_registry``  the live sequences and user requests; forks, releases and the single terminal
                         reclaim routine
- ``stats``              engine counters and the ``/load`` snapshot
- ``capacity_plan``      how many KV blocks the cache gets and how long a context the engine accepts
- ``memory_profile``     the KV budget on a GPU from ``gpu_memory_utilization`` and one profiled step of the
                         largest size
- ``kv/``                block hashing (shared with the router), block pool, KV cache tensors, KV manager
- ``distributed/``       tensor parallelism: process groups, sharded layers and weights, the worker processes
                         and rank 0's executor (torch.distributed, NCCL/gloo)
- ``model/``             Llama-architecture model, HF/GGUF loaders, tiny random model for tests
- ``attention/``         attention-backend interface; PyTorch path (CPU) and Triton kernels (GPU)
- ``native/``            fused float32 C kernels for the CPU hot loop (norm, RoPE, K/V write, SiLU-mul, paged
                         attention, the GEMM of decode steps), compiled once per host; PyTorch references
                         beside them
- ``sampling/``          ``SamplingParams`` and the logits → token pipeline
- ``spec_decode/``       speculative decoding: which sequences draft, prompt-lookup proposals, verification
                         by the exact accept/reject rule
- ``structured/``        structured outputs: constraint parameters, grammar compile (cached, off the engine
                         thread), per-sequence matchers, the token bitmask of the sampler's constraint stage

Heavy names (``LLM``, ``SamplingParams``, …) are imported lazily so that modules the router shares
(``kvpilot.engine.kv.block_hash``, ``kvpilot.engine.tokenizer``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.engine_core",
    "EngineArgs": "kvpilot.engine.engine_args",
    "EngineConfig": "kvpilot.engine.config",
    "SamplingParams": "kvpilot.engine.sampling.params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "EngineConfig",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
]

if TYPE_CHECKING:  # pragma: no cover
    from kvpilot.engine.config import EngineConfig
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.engine_core import LLMEngine
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.outputs import CompletionOutput, RequestOutput
    from kvpilot.engine.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
