"""Sampling: parameters and the logits → token pipeline (docs/architecture.md#sampling-pipeline).

- ``params``             ``SamplingParams`` (vLLM names), validated on construction
- ``logits_processors``  hard constraints (allowed ids, logit bias, bad words, min tokens, n-gram bans) and
                         penalties (repetition, frequency, presence), batched over the rows that use them
- ``filters``            truncation with exact support sets: min-p, top-k (no sort), top-p (on top-k
                         candidates, full sort only for flat rows), typical-p; sort-based references
- ``draw``               one token per row by a two-level inverse CDF (one uniform number per row)
- ``row_params``         per-row parameters as one tensor (``SamplingTensors``) and the rows each filter
                         touches, decided on the host (``FilterRows``)
- ``sampler``            the batched pipeline: greedy / temperature / filters / draw, per-request generators
- ``sampler_output``     what it gives back: tokens, sampled and top-N logprobs, beams' whole distributions
"""
