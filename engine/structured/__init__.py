"""Structured outputs: grammars that constrain generation (docs/architecture.md#structured-outputs).

- ``params``    ``StructuredOutputsParams`` (vLLM's names: json, regex, choice, grammar, json_object),
                validated and bounded in size on construction; no llguidance, no torch
- ``grammar``   a spec → llguidance grammar text, and llguidance's verdict on it (its limits, the
                grammar's first step) as a ``GrammarError`` that names the unsupported JSON-schema keyword
- ``compiler``  ``GrammarCompiler``: compiles on its own deep-stack thread pool, cached by (kind, text)
- ``matcher``   ``GrammarMatcher``: one sequence's place in its grammar, advanced by each accepted token
- ``bitmask``   the token bitmask: filled for every constrained row at once, applied to the logits on
                their device as −inf on illegal tokens
"""
