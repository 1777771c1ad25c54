"""Fixtures shared by the engine's structured-output tests: the tiny model's tokenizer and a grammar
compiler on it (one per test module)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> Iterator[GrammarCompiler]:
    c = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    yield c
    c.close()
