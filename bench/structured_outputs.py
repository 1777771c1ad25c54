"""Grammar backends for structured outputs, side by side on SmolLM2's 49,152-token vocabulary: llguidance
and xgrammar (the two vLLM and SGLang use). Decides docs/architecture.md#structured-outputs.

    python bench/structured_outputs.py backends     # tokenizer set-up, compile, mask cost, coverage
    python bench/structured_outputs.py engine       # kvpilot's engine: the mask's share of a decode step

``backends`` measures, per backend:

- set-up: building the backend's tokenizer (once per engine);
- compile: each benchmark schema, cold (the backend's own cache cleared or bypassed);
- mask cost per token: a matcher walks the tokens of a document that satisfies the schema (the model's
  own tokenization); each step fills the 49,152-bit mask, then accepts the token. Mean and p99 per token,
  in this thread's CPU time (robust on a shared host); and a decode batch of 32 matchers at staggered
  places in the document, one batched fill per step (wall clock: the backends fill on worker threads);
- JSON-schema coverage: per keyword, a schema using it, a document that satisfies it and one that breaks
  only that keyword. ``enforced`` = the first is accepted and the second refused; ``refused`` = compiling
  it fails (kvpilot turns that into a 400 naming the keyword); ``ignored`` = it compiles but the breaking
  document passes (the worst outcome: a schema silently not honoured).

``engine`` runs kvpilot's engine on SmolLM2 with ``--batch`` greedy requests and times ``--steps`` decode
steps once all of them are decoding, first unconstrained, then with every request under the "nested +
arrays + enum" schema: step time (median), and the sampler's grammar stage alone (``GrammarMasks``: the
batched fill and the bitmask applied to the logits), per step and as a share of the constrained step.
Only llguidance is needed for it.

Both backends must be installed (``pip install --no-deps llguidance xgrammar apache-tvm-ffi``; xgrammar
also imports transformers, a dev dependency here). Only llguidance is a kvpilot dependency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from kvpilot.engine.model.registry import resolve_model
from kvpilot.engine.tokenizer import Tokenizer

VOCAB_NOTE = "SmolLM2-135M-Instruct (49,152 tokens)"

#: the documents each backend walks for the mask cost, with their schemas
PERF_CASES: dict[str, tuple[dict, Any]] = {
    "flat object": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "ok": True},
    ),
    "nested + arrays + enum": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1},
                        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                    },
                    "required": ["id", "tags"],
                },
                "status": {"enum": ["active", "suspended", "deleted"]},
                "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1},
            },
            "required": ["user", "status", "scores"],
        },
        {"user": {"id": 42, "tags": ["admin", "ops"]}, "status": "active", "scores": [0.5, 12.25, 3]},
    ),
    "free json_object": ({"type": "object"}, {"city": "Paris", "facts": [1, 2, {"k": "v"}], "x": None}),
}


def _coverage_cases() -> list[tuple[str, dict, Any, Any]]:
    """(keyword, schema, satisfying document, document breaking only that keyword)."""
    obj = {"type": "object"}
    return [
        (
            "type/properties/required",
            {**obj, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
            {"a": 1},
            {},
        ),
        (
            "additionalProperties: false",
            {**obj, "properties": {"a": {"type": "integer"}}, "additionalProperties": False},
            {"a": 1},
            {"a": 1, "b": 2},
        ),
        (
            "additionalProperties: schema",
            {**obj, "additionalProperties": {"type": "integer"}},
            {"x": 1},
            {"x": "s"},
        ),
        ("enum", {"enum": ["red", "green"]}, "red", "blue"),
        ("const", {"const": "fixed"}, "fixed", "other"),
        ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 9}, 5, 10),
        ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
        ("multipleOf", {"type": "integer", "multipleOf": 5}, 15, 7),
        ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, "abc", "abcd"),
        ("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "abc-12"),
        ("format: date", {"type": "string", "format": "date"}, "2024-05-01", "yesterday"),
        ("format: email", {"type": "string", "format": "email"}, "a@b.co", "not an email"),
        (
            "minItems/maxItems",
            {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
            [1, 2],
            [1, 2, 3],
        ),
        (
            "prefixItems",
            {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
            ["a", 1],
            [1, "a"],
        ),
        ("uniqueItems", {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
        ("contains", {"type": "array", "contains": {"const": 3}}, [1, 3], [1, 2]),
        ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "s"),
        ("oneOf", {"oneOf": [{"type": "integer"}, {"type": "string"}]}, "s", None),
        ("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, 4, 2),
        (
            "$ref/$defs",
            {
                "$defs": {"p": {"type": "integer"}},
                **obj,
                "properties": {"a": {"$ref": "#/$defs/p"}},
                "required": ["a"],
            },
            {"a": 1},
            {"a": "s"},
        ),
        (
            "recursive $ref",
            {
                "$defs": {
                    "n": {
                        **obj,
                        "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                        "required": ["c"],
                        "additionalProperties": False,
                    }
                },
                "$ref": "#/$defs/n",
            },
            {"c": [{"c": []}]},
            {"c": [{}]},
        ),
        (
            "patternProperties",
            {**obj, "patternProperties": {"^n_": {"type": "integer"}}, "additionalProperties": False},
            {"n_a": 1},
            {"n_a": "s"},
        ),
        ("minProperties", {**obj, "minProperties": 1}, {"a": 1}, {}),
        ("propertyNames", {**obj, "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"AB": 1}),
        ("not", {"not": {"type": "string"}}, 1, "s"),
        (
            "if/then/else",
            {"if": {"type": "integer"}, "then": {"minimum": 0}, "else": {"type": "string"}},
            1,
            -1,
        ),
        (
            "dependentRequired",
            {**obj, "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
            {"a": 1, "b": 2},
            {"a": 1},
        ),
    ]


def _cpu_ms(fn: Callable[[], object]) -> float:
    start = time.thread_time()
    fn()
    return (time.thread_time() - start) * 1e3


def _wall_ms(fn: Callable[[], object]) -> float:
    """Wall clock: a batched fill runs on the backend's own worker threads, which this thread's CPU time
    would not see."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        import llguidance
        import llguidance.torch as llt  # imports torch: before the timed set-up, as xgrammar's import

        self.ll, self.llt = llguidance, llt
        self.vocab = tokenizer.vocab_size
        self.tok = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=self.vocab, eos_token=sorted(tokenizer.eos_token_ids)
        )
        self.executor = llguidance.LLExecutor(num_threads=threads)

    def compile(self, schema: dict) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"lenient": False})
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error and not error.startswith("WARNING"):
            raise ValueError(error)
        return grammar

    def matcher(self, compiled: Any) -> Any:
        m = self.ll.LLMatcher(self.tok, compiled, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m

    def bitmask(self, rows: int) -> Any:
        return self.llt.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m: Any, mask: Any, row: int = 0) -> None:
        self.llt.fill_next_token_bitmask(m, mask, row)

    def fill_batch(self, ms: list[Any], mask: Any) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(ms)], mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def accepts_doc(self, m: Any, tokens: list[int]) -> bool:
        return m.try_consume_tokens(tokens) == len(tokens) and m.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Tokenizer, threads: int) -> None:
        import transformers
        import xgrammar

        self.xg, self.threads = xgrammar, threads
        self.vocab = tokenizer.vocab_size
        hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
        info = xgrammar.TokenizerInfo.from_huggingface(
            hf, vocab_size=self.vocab, stop_token_ids=sorted(tokenizer.eos_token_ids)
        )
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict) -> Any:
        return self.compiler.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled: Any) -> Any:
        return self.xg.GrammarMatcher(compiled)

    def bitmask(self, rows: int) -> Any:
        return self.xg.allocate_token_bitmask(rows, self.vocab)

    def fill(self, m: Any, mask: Any, row: int = 0) -> None:
        m.fill_next_token_bitmask(mask, row)

    def fill_batch(self, ms: list[Any], mask: Any) -> None:
        batch = self.xg.BatchGrammarMatcher(max_threads=self.threads)
        batch.batch_fill_next_token_bitmask(ms, mask)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def accepts_doc(self, m: Any, tokens: list[int]) -> bool:
        return all(m.accept_token(t) for t in tokens) and m.is_completed()


def _doc_tokens(tokenizer: Tokenizer, doc: Any) -> list[int]:
    return tokenizer.encode(json.dumps(doc, separators=(", ", ": ")), add_special_tokens=False)


def bench_backend(backend: Any, tokenizer: Tokenizer, repeat: int) -> dict:
    out: dict[str, Any] = {"compile_ms": {}, "mask_ms": {}, "coverage": {}}
    for label, (schema, doc) in PERF_CASES.items():
        out["compile_ms"][label] = min(_cpu_ms(lambda s=schema: backend.compile(s)) for _ in range(repeat))
        compiled = backend.compile(schema)
        tokens = _doc_tokens(tokenizer, doc)
        per_token: list[float] = []
        for _ in range(repeat):
            m, mask = backend.matcher(compiled), backend.bitmask(1)
            for t in tokens:
                per_token.append(_cpu_ms(lambda m=m, mask=mask: backend.fill(m, mask)))
                if not backend.accept(m, t):
                    raise AssertionError(f"{backend.name} refused its own document at {t} ({label})")
        per_token.sort()
        # a decode batch: 32 matchers at staggered places in the document, each step one batched fill and
        # one token each (a matcher that reaches the end starts over as a new request would)
        pos = [i % len(tokens) for i in range(32)]
        ms = []
        for p in pos:
            m = backend.matcher(compiled)
            for t in tokens[:p]:
                backend.accept(m, t)
            ms.append(m)
        mask32, fills = backend.bitmask(32), []
        for _ in range(repeat * len(tokens)):
            fills.append(_wall_ms(lambda ms=ms, mask32=mask32: backend.fill_batch(ms, mask32)))
            for i, m in enumerate(ms):
                backend.accept(m, tokens[pos[i]])
                pos[i] += 1
                if pos[i] == len(tokens):
                    ms[i], pos[i] = backend.matcher(compiled), 0
        batch = statistics.fmean(fills)
        out["mask_ms"][label] = {
            "tokens": len(tokens),
            "mean": statistics.fmean(per_token),
            "p99": per_token[min(len(per_token) - 1, int(0.99 * len(per_token)))],
            "batch32": batch,
        }
    for keyword, schema, good, bad in _coverage_cases():
        try:
            compiled = backend.compile(schema)
            ok = backend.accepts_doc(backend.matcher(compiled), _doc_tokens(tokenizer, good))
            broken = backend.accepts_doc(backend.matcher(compiled), _doc_tokens(tokenizer, bad))
            verdict = "enforced" if ok and not broken else ("ignored" if ok else "rejects valid")
        except Exception as err:  # a backend's refusal is a result here, whatever its type
            verdict = f"refused ({type(err).__name__})"
        out["coverage"][keyword] = verdict
    return out


def run_backends(args: argparse.Namespace) -> None:
    tokenizer = Tokenizer.from_dir(resolve_model("smollm2-135m", progress=False))
    results = {}
    import llguidance.torch  # noqa: F401 - torch and transformers load outside the timed set-up
    import transformers  # noqa: F401
    import xgrammar  # noqa: F401

    for cls in (Llguidance, Xgrammar):
        start = time.perf_counter()
        backend = cls(tokenizer, args.threads)
        setup = (time.perf_counter() - start) * 1e3
        results[cls.name] = {"setup_ms": setup, **bench_backend(backend, tokenizer, args.repeat)}
    names = list(results)
    print(
        f"vocabulary: {VOCAB_NOTE}; times: best/mean of {args.repeat} rounds, thread CPU time; "
        f"batched fill on {args.threads} worker thread(s)\n"
    )
    print("| | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    print(
        "| tokenizer set-up (ms, wall) | " + " | ".join(f"{results[n]['setup_ms']:.0f}" for n in names) + " |"
    )
    for label in PERF_CASES:
        cells = [f"{results[n]['compile_ms'][label]:.2f}" for n in names]
        print(f"| compile `{label}` (ms) | " + " | ".join(cells) + " |")
    for label in PERF_CASES:
        cells = [
            "{mean:.3f} / {p99:.3f} ({tokens} tok)".format(**results[n]["mask_ms"][label]) for n in names
        ]
        print(f"| mask per token, mean / p99 `{label}` (ms) | " + " | ".join(cells) + " |")
        cells = [f"{results[n]['mask_ms'][label]['batch32']:.3f}" for n in names]
        print(
            f"| batched fill, 32 matchers per decode step, mean `{label}` (ms, wall) | "
            + " | ".join(cells)
            + " |"
        )
    print("\n| keyword | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for keyword in results[names[0]]["coverage"]:
        print(f"| {keyword} | " + " | ".join(results[n]["coverage"][keyword] for n in names) + " |")
    for n in names:
        enforced = sum(v == "enforced" for v in results[n]["coverage"].values())
        print(f"\n{n}: {enforced}/{len(results[n]['coverage'])} keywords enforced")


def run_engine(args: argparse.Namespace) -> None:
    from kvpilot.engine.engine_args import EngineArgs
    from kvpilot.engine.engine_core import LLMEngine
    from kvpilot.engine.sampling.params import SamplingParams
    from kvpilot.engine.structured.params import StructuredOutputsParams

    config = EngineArgs.from_kwargs(
        model="smollm2-135m", num_kv_blocks=2048, max_num_seqs=args.batch, max_num_batched_tokens=4096
    ).create_config()
    engine = LLMEngine(config)
    schema, _ = PERF_CASES["nested + arrays + enum"]
    masks = engine.sampler.grammar_masks
    print(f"SmolLM2-135M, {args.batch} greedy requests, {args.steps} decode steps each way, {engine.device}")
    for label, spec in (("unconstrained", None), ("json_schema", StructuredOutputsParams(json=schema))):
        params = SamplingParams(
            temperature=0, max_tokens=args.steps + 8, ignore_eos=True, structured_outputs=spec
        )
        for i in range(args.batch):
            engine.add_request(f"{label}-{i}", f"Describe inventory item number {i} as JSON:", params)
        while any(not r.output_token_ids for r in engine.sequences.values()):  # prefill every request
            engine.step()
        rows, seconds, steps = masks.rows, masks.seconds, []
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - start) * 1e3)
        running = len(engine.sequences)
        mask_ms = (masks.seconds - seconds) * 1e3 / args.steps
        line = f"{label:14s} step p50 {statistics.median(steps):7.2f} ms (min {min(steps):.2f})"
        if masks.rows > rows:
            share = mask_ms / statistics.median(steps)
            line += (
                f"; grammar mask {mask_ms:.2f} ms/step ({share:.1%} of the step), {running} rows at the end"
            )
        print(line)
        for request_id in list(engine.groups):
            engine.abort_request(request_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("backends")
    b.add_argument("--repeat", type=int, default=5)
    b.add_argument("--threads", type=int, default=1, help="worker threads of the batched fill")
    e = sub.add_parser("engine")
    e.add_argument("--batch", type=int, default=32)
    e.add_argument("--steps", type=int, default=16)
    args = parser.parse_args(argv)
    if args.mode == "backends":
        run_backends(args)
    else:
        run_engine(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
