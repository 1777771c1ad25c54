"""The device engine-level tests run on: the CPU by default (CI), a GPU with ``KVPILOT_TEST_DEVICE=cuda``.

Tests pass ``**ENGINE_DEVICE`` to ``LLM(...)`` so that on a GPU machine the same cases (parallel samples,
best_of, beams, swap, logprobs, penalties, seeds, prefix hits) run on CUDA — in float32, so they keep
comparing exactly with the float32 references. ``bench/gpu_check.sh`` runs them that way.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("KVPILOT_TEST_DEVICE", "cpu"))
if DEVICE.type not in ("cpu", "cuda") or (DEVICE.type == "cuda" and not torch.cuda.is_available()):
    raise RuntimeError(f"KVPILOT_TEST_DEVICE={DEVICE}: engine tests run on 'cpu' or an available 'cuda'")
if DEVICE.type == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as triton_device: set before any kernel module loads
#: engine arguments that place the engine on the test device in float32
ENGINE_DEVICE = {"device": str(DEVICE), "dtype": "float32"}
