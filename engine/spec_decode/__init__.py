"""Speculative decoding (docs/architecture.md#speculative-decoding): propose k tokens cheaply, score them
with the target model in one forward, keep the longest prefix the exact rule accepts.

- ``config``          ``speculative_config`` (vLLM's keys) → ``SpeculativeConfig``
- ``drafting``        which sequences draft this step and how many tokens each may propose
- ``draft_model``     the draft-model proposer: a smaller model with the target's tokenizer, its paged KV
                      over the target's blocks
- ``ngram_proposer``  prompt lookup: the tokens that followed the latest earlier occurrence of the
                      sequence's trailing n-gram (the deterministic-q proposer)
- ``rejection``       the exact accept/reject rule over a batch of drafts: greedy (longest matching
                      prefix plus the bonus token) and sampled (accept with min(1, p/q), else draw from
                      norm(max(0, p - q))), one uniform per decision from the row's own generator
- ``verify``          a step's drafts through the whole sampling pipeline, then the rule: what each
                      speculating sequence emits
"""
