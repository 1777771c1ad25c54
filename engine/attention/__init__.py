"""Paged attention behind one backend interface.

- ``metadata``  ``AttentionMetadata``: the flattened batch layout one forward step attends over
- ``backend``   ``AttentionBackend`` interface and ``select_backend`` (auto | torch | triton)
- ``rotation``  ``QKRotation``: the RoPE a backend may apply inside its KV write (one launch)
- ``torch_backend``   the PyTorch path (CPU default): gathers paged K/V and runs SDPA
- ``torch_plans``     its per-step plan, shared by every layer (decode buckets, prefill plans, slots)
- ``triton_backend``  the Triton kernels (CUDA default; runs in the interpreter on CPU for tests)
- ``triton_checks``   host-side checks of what the kernels are handed (layout, caches, q/k/v rows)
- ``triton_loader``   imports the kernels compiled (CUDA) or interpreted (CPU), refusing a mixed import
- ``gpu_preflight``   the start-up check that Triton can build and launch a kernel (names what is missing)
- ``kernels/``        the Triton kernels themselves, one per module, with their PyTorch references
"""

from kvpilot.engine.attention.backend import AttentionBackend, select_backend
from kvpilot.engine.attention.metadata import AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "select_backend"]
