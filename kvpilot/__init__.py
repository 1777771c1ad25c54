"""kvpilot — Kubernetes-native LLM serving.

Package map (import names; each part has its own top-level folder, see docs/architecture.md#package-map):
- ``kvpilot``            the version (``__version__``) and the OpenMP wait policy set before torch loads
- ``cli``                ``kvpilot.cli``: the ``kvpilot`` command, dispatching to each part's own CLI module
- ``bench/``             ``kvpilot.bench``: serving/offline benchmark tools behind ``kvpilot bench``
- ``kvpilot.engine``     paged-KV inference engine, offline ``LLM`` API, OpenAI server (folder ``engine/``)
- ``kvpilot.router``     cache-aware routing sidecar (folder ``router/``)
- ``kvpilot.operator``   Kopf operator for ``InferenceService`` (folder ``operator/``)
"""

import os as _os

# How idle OpenMP workers wait. Spinning forever (ACTIVE) collapses when the cores are shared (another
# engine replica, a router, the test runner): a 16x576x1536 GEMM on 2 threads took 15.7 ms with
# spinning workers on a 2-core machine busy with two other processes, 1.4 ms with passive ones. Sleeping at
# once (PASSIVE) costs a futex wake-up in each of a decode step's ~300 parallel regions: decode steps at
# batch 16 ran 10% slower than with spinning workers (4 alternating rounds: 113 vs 101 ms). So workers
# spin briefly (libgomp's GOMP_SPINCOUNT: 20000 pauses, ~0.2 ms, longer than the gap between two ops of
# a forward pass) and then sleep: decode as fast as ACTIVE, a shared or idle machine as with PASSIVE
# (busy: 1.1 ms p50). libgomp reads these when torch loads, so they are set before any kvpilot module can
# import torch; a user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT wins, and then neither is added.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # other OpenMP runtimes: sleep when idle
    _os.environ["GOMP_SPINCOUNT"] = "20000"  # libgomp (torch's): after a short spin

__version__ = "0.1.0"
