"""kvpilot vs vLLM's CPU build vs HF transformers: runs :mod:`kvpilot.bench.compare.side_by_side`.

  .venv/bin/python bench/compare_vllm.py --help    # flags, defaults and what is written where

A script so that it runs from the repo root too (``python -m`` there would import the repo's
``operator/`` instead of the stdlib module).
"""

import sys

from kvpilot.bench.compare.side_by_side import main

if __name__ == "__main__":
    sys.exit(main())
