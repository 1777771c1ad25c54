"""Sampling: parameters and the logits → token pipeline.

- ``params``   ``SamplingParams`` (vLLM names), validated on construction
- ``sampler``  batched sampler: greedy / temperature / top-k / top-p with per-request generators
"""
