"""``GrammarCompiler``: constraints → compiled grammars, off the engine thread and cached
(docs/architecture.md#structured-outputs).

Compiling runs on the compiler's own thread pool. ``compile`` returns a future at once: the HTTP handler
awaits it (an invalid schema is a 400 before the request is queued) and the engine, given the same
parameters, finds it in the cache done. The llguidance tokenizer (the model's vocabulary with its token
trie, ~0.5 s for 49k tokens) is built on the pool when the compiler is made, so neither thread waits for
it unless the first compile comes sooner. The cache is keyed by ``StructuredOutputsParams.key`` (kind,
text, whitespace mode), least recently used entries beyond ``cache_size`` dropped; a failed compile is
cached too, so a bad schema sent again fails without recompiling.

The pool's threads have ``COMPILE_STACK_BYTES`` of stack: llguidance recurses once per level of a chain of
Lark rules (``a0: a1``, ``a1: a2``, ...; ~3 KB a level), and a 5,000-rule chain overflowed a default 8 MiB
thread stack, a segmentation fault that took the whole server down. 512 MiB holds the deepest chain that
fits in ``MAX_CONSTRAINT_BYTES`` (~87,000 rules in 1 MiB); it is address space, touched only as deep as a
grammar goes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import llguidance

from kvpilot.engine.structured.grammar import build_matcher, grammar_text
from kvpilot.engine.structured.matcher import GrammarMatcher
from kvpilot.engine.structured.params import StructuredOutputsParams
from kvpilot.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_CACHE_SIZE = 512
#: the stack of each compile thread (see above)
COMPILE_STACK_BYTES = 512 << 20
#: held from setting the process-wide stack size to restoring it: two compilers made at once (two engines
#: built on two threads) would otherwise interleave, the second restoring the first's 512 MiB for good
_STACK_SIZE_LOCK = threading.Lock()


@dataclass(frozen=True)
class CompiledGrammar:
    kind: str
    #: the grammar's matcher at its start, never advanced: each request's matcher is a copy (~2 µs, where
    #: building one from the grammar text is the ~1 ms compile)
    template: llguidance.LLMatcher
    compile_seconds: float

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self.template.deep_copy(), self.kind)


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        eos_token_ids: Iterable[int],
        *,
        workers: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
        on_compiled: Callable[[str, float], None] | None = None,
    ) -> None:
        """``vocab_size``: the model's logits width (the mask covers every row of it; ids the tokenizer
        does not know are never allowed). ``on_compiled(kind, seconds)`` is called after each compile."""
        self._pool = _deep_stack_pool(workers)
        self._tokenizer: Future[llguidance.LLTokenizer] = self._pool.submit(
            llguidance.LLTokenizer,
            tokenizer.backend.to_str(),
            n_vocab=vocab_size,
            eos_token=sorted(eos_token_ids),
        )
        self._cache: OrderedDict[tuple[str, str, bool], Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()
        self._cache_size = cache_size
        self.on_compiled = on_compiled
        #: cache lookups answered from the cache / that started a compile
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Future[CompiledGrammar]:
        """The compiled grammar of ``spec``; the future raises ``GrammarError`` if it does not compile."""
        key = spec.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return future

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher for ``spec``, waiting for its compile if it is not cached yet."""
        return self.compile(spec).result().matcher()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        tokenizer = self._tokenizer.result()
        start = time.perf_counter()
        template = build_matcher(grammar_text(spec), tokenizer, spec.kind)
        seconds = time.perf_counter() - start
        if self.on_compiled is not None:
            self.on_compiled(spec.kind, seconds)
        return CompiledGrammar(spec.kind, template, seconds)


def _deep_stack_pool(workers: int) -> ThreadPoolExecutor:
    """A pool whose ``workers`` threads are all started now, under ``COMPILE_STACK_BYTES`` of stack (the
    size is process-wide while it is set, and a pool starts its threads lazily, so each is made to start
    here: one blocking task per thread, released once all have started). A host that will not map such a
    stack (strict overcommit) gets default stacks and a warning, not an engine that fails to start."""
    pool = ThreadPoolExecutor(workers, thread_name_prefix="kvpilot-grammar")
    with _STACK_SIZE_LOCK:
        previous = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            probe = threading.Thread(target=lambda: None, name="kvpilot-grammar-probe")
            probe.start()
        except RuntimeError as err:
            threading.stack_size(previous)
            log.warning(
                "grammar compile threads keep the default stack (%s with %d MiB): a deeply nested grammar "
                "may overflow it",
                err,
                COMPILE_STACK_BYTES >> 20,
            )
            return pool
        probe.join()
        started = threading.Barrier(workers + 1)
        try:
            waits: list[Future[Any]] = [pool.submit(started.wait) for _ in range(workers)]
        finally:
            threading.stack_size(previous)
    started.wait()
    for wait in waits:
        wait.result()
    return pool
