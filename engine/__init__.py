"""kvpilot.engine — the paged-KV inference engine.

Package map:
- ``config``      typed engine configuration (``EngineArgs`` → ``EngineConfig``), validated at the boundary
- ``model/``      Llama-architecture model, HF/GGUF loaders, tiny random model for tests
- ``tokenizer``   tokenizer + chat template (shared with the router); ``chat_skeleton`` renders templates
                  that only emit message contents by splicing them into a cached skeleton
- ``kv/``         block hashing (shared with the router), block pool, KV cache tensors, KV cache manager
- ``attention/``  attention-backend interface; PyTorch path (CPU) and Triton kernels (GPU)
- ``native/``     fused float32 C kernels for the CPU hot loop (norm, RoPE, K/V write, SiLU-mul, paged
                  decode attention, the GEMM of decode steps), compiled once per host; PyTorch references
                  beside them
- ``sampling/``   ``SamplingParams`` and the sampler
- ``request``     request state and the lifecycle state machine
- ``scheduler``   token-budget scheduler: continuous batching, chunked prefill, preemption
- ``model_runner`` builds the flattened batch and runs the model
- ``capacity_plan`` how many KV blocks and how long a context; ``memory_profile`` the KV budget on a GPU
                  from ``gpu_memory_utilization`` and one profiled step of the largest size
- ``engine_core`` ``LLMEngine``: add requests, step, outputs
- ``llm``         offline ``LLM`` API (vLLM-shaped)
- ``server/``     OpenAI-compatible HTTP server (``kvpilot serve``)

Heavy names (``LLM``, ``SamplingParams``, …) are imported lazily so that modules the router shares
(``kvpilot.engine.kv.block_hash``, ``kvpilot.engine.tokenizer``) load without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_LAZY = {
    "LLM": "kvpilot.engine.llm",
    "LLMEngine": "kvpilot.engine.engine_core",
    "EngineArgs": "kvpilot.engine.config",
    "EngineConfig": "kvpilot.engine.config",
    "SamplingParams": "kvpilot.engine.sampling.params",
    "RequestOutput": "kvpilot.engine.outputs",
    "CompletionOutput": "kvpilot.engine.outputs",
}

__all__ = ["LLM", "CompletionOutput", "EngineArgs", "EngineConfig", "LLMEngine", "RequestOutput",
           "SamplingParams"]

if TYPE_CHECKING:  # pragma: no cover
    from kvpilot.engine.config import EngineArgs, EngineConfig
    from kvpilot.engine.engine_core import LLMEngine
    from kvpilot.engine.llm import LLM
    from kvpilot.engine.outputs import CompletionOutput, RequestOutput
    from kvpilot.engine.sampling.params import SamplingParams


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpilot.engine' has no attribute {name!r}")
