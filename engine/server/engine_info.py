"""Facts about the loaded engine that never change after loading: the HTTP side validates and tokenizes
with them without ever touching the (not thread-safe) engine itself."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpilot.engine.config import EngineConfig
from kvpilot.engine.kv.events import KVEventLog
from kvpilot.engine.prompt_bound import max_chars_per_token
from kvpilot.engine.structured.compiler import GrammarCompiler
from kvpilot.engine.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch: only the engine thread imports the engine
    from kvpilot.engine.engine_core import LLMEngine


@dataclass(frozen=True)
class EngineInfo:
    served_model_name: str
    #: thread-safe for encoding and chat-template rendering
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    max_logprobs: int
    block_size: int
    kv_blocks_total: int
    #: hex of the block-hash chain's root (``/kv/*``'s ``root``)
    root_hex: str
    #: thread-safe reads (``since``); written by the engine thread
    kv_events: KVEventLog
    #: the engine's grammar compiler (thread-safe): handlers compile structured outputs before queueing
    grammars: GrammarCompiler
    #: the most characters one token can stand for (None: no sound bound for this tokenizer)
    max_chars_per_token: int | None = None

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> EngineInfo:
        sc = engine.config.scheduler
        return cls(
            served_model_name=engine.served_model_name,
            tokenizer=engine.tokenizer,
            vocab_size=engine.arch.vocab_size,
            max_model_len=engine.max_model_len,
            max_num_seqs=sc.max_num_seqs,
            max_num_batched_tokens=sc.max_num_batched_tokens,
            enable_chunked_prefill=sc.enable_chunked_prefill,
            max_logprobs=engine.config.max_logprobs,
            block_size=engine.kv.block_size,
            kv_blocks_total=engine.pool.num_usable,
            root_hex=engine.kv.root_hash.hex(),
            kv_events=engine.kv_events,
            grammars=engine.grammars,
            max_chars_per_token=max_chars_per_token(engine.tokenizer),
        )


def served_model_name(config: EngineConfig) -> str:
    """The engine's own rule (``--served-model-name``, else ``--model``), known before the engine loads."""
    return config.model.served_model_name or config.model.model


def placeholder_load(config: EngineConfig) -> dict:
    """``/load`` before the engine exists: nothing queued, no blocks, measured rates 0 (contract fields)."""
    sc = config.scheduler
    return {
        "model": served_model_name(config),
        "epoch": "",
        "waiting": 0,
        "running": 0,
        "swapped": 0,
        "queued_prefill_tokens": 0,
        "running_decode_tokens": 0,
        "kv_blocks_total": 0,
        "kv_blocks_free": 0,
        "kv_blocks_cached": 0,
        "kv_blocks_reserved": 0,
        "kv_usage": 0.0,
        "block_size": config.cache.block_size,
        "max_model_len": 0,
        "kv_cache_bytes": 0,
        "kv_cache_sizing": "",
        "kv_cache_dtype": "",
        "quantization": "",
        "dtype": "",
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "prefill_tokens_per_second": 0.0,
        "decode_step_seconds": 0.0,
        "pending_admission": 0,
        "backpressured": 0,
    }
