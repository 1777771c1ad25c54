"""Where the Triton tests run: the CPU interpreter by default (CI), or a GPU with
``KVPILOT_TEST_DEVICE=cuda``.

Import this before anything that imports the kernel modules: on CPU it sets ``TRITON_INTERPRET=1``
first, because Triton reads that variable when a kernel module is imported. On a GPU machine,
``KVPILOT_TEST_DEVICE=cuda pytest -m triton tests/engine`` compiles the same kernels and runs the same
cases against the same references.
"""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("KVPILOT_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
elif DEVICE.type != "cuda" or not torch.cuda.is_available():
    raise RuntimeError(f"KVPILOT_TEST_DEVICE={DEVICE}: the Triton tests run on 'cpu' or an available 'cuda'")
