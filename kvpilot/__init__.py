"""kvpilot — Kubernetes-native LLM serving.

Package map (import names; folders per DESIGN.md):
- ``kvpilot``            version and the ``kvpilot`` CLI dispatcher (``kvpilot.cli``)
- ``kvpilot.engine``     paged-KV inference engine, offline ``LLM`` API, OpenAI server (folder ``engine/``)
- ``kvpilot.router``     cache-aware routing sidecar (folder ``router/``)
- ``kvpilot.operator``   Kopf operator for ``InferenceService`` (folder ``operator/``)
- ``kvpilot.bench``      serving/offline benchmark tools behind ``kvpilot bench``
"""

import os as _os

# OpenMP threads that spin while waiting for work collapse when the cores are shared (another engine
# replica, a router, the kernel's own work): measured here, a 16x576x1536 GEMM on 2 threads took 16 ms
# with spinning workers on a busy 2-core machine and 0.95 ms with passive ones. libgomp reads this when
# torch loads, so it is set before any kvpilot module can import torch; an explicit setting wins.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
