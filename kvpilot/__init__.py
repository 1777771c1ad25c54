"""kvpilot — Kubernetes-native LLM serving.

Package map (import names; folders per DESIGN.md):
- ``kvpilot``            version and the ``kvpilot`` CLI dispatcher (``kvpilot.cli``)
- ``kvpilot.engine``     paged-KV inference engine, offline ``LLM`` API, OpenAI server (folder ``engine/``)
- ``kvpilot.router``     cache-aware routing sidecar (folder ``router/``)
- ``kvpilot.operator``   Kopf operator for ``InferenceService`` (folder ``operator/``)
- ``kvpilot.bench``      serving/offline benchmark tools behind ``kvpilot bench``
"""

__version__ = "0.1.0"
