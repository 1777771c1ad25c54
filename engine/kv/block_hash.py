"""The prefix-cache block hash chain, shared by the engine and the router (no torch import here).

For each *full* block i of a token sequence: ``h_i = H(h_{i-1}, tokens of block i, extra_keys)``, where H is
BLAKE2b-128 over a canonical byte encoding (never Python's salted ``hash``), ``h_{-1}`` derives from the
model identity, and ``extra_keys`` carry the adapter id and the tenant's cache salt. Because the salt enters
every block's hash, two tenants never share a block, so cache hits (and their timing) cannot leak one
tenant's prefix to another.
"""

from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

HASH_BYTES = 16
# array("I") holds C unsigned ints in native byte order: the canonical encoding where they are LE uint32.
_NATIVE_IS_CANONICAL = array("I").itemsize == 4 and sys.byteorder == "little"
_DOMAIN = b"kvpilot-block-hash-v1"


def _h(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for part in parts:
        h.update(struct.pack("<I", len(part)))  # length-prefix every field: no ambiguous concatenation
        h.update(part)
    return h.digest()


def root_hash(model_identity: str) -> bytes:
    """``h_{-1}``: the chain's root for one model identity (weights, tokenizer, KV dtype)."""
    return _h(_DOMAIN, model_identity.encode())


def encode_extra_keys(cache_salt: str | None = None, adapter_id: str | None = None) -> bytes:
    """Canonical encoding of the extra keys; empty when neither is set."""
    if cache_salt is None and adapter_id is None:
        return b""
    return _h(
        b"extra",
        (adapter_id or "").encode(),
        b"\x01" if cache_salt is not None else b"\x00",
        (cache_salt or "").encode(),
    )


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes = b"") -> bytes:
    return _h(parent, token_bytes(tokens), extra)


def hash_block_bytes(parent: bytes, block_token_bytes: bytes, extra: bytes = b"") -> bytes:
    """:func:`hash_block` of tokens already encoded by :func:`token_bytes` (callers that slice one buffer)."""
    return _h(parent, block_token_bytes, extra)


def token_bytes(tokens: Sequence[int]) -> bytes:
    """The canonical encoding of token ids inside a block hash: little-endian uint32 each."""
    if _NATIVE_IS_CANONICAL:
        return array("I", tokens).tobytes()  # one C loop; the same bytes as the struct form below
    return struct.pack(f"<{len(tokens)}I", *tokens)


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    root: bytes,
    extra: bytes = b"",
    start: int = 0,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of the full blocks of ``token_ids`` from block index ``start`` on (``parent`` = hash of block
    ``start - 1``, or the root when ``start == 0``)."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent hash is required when start > 0")
    out: list[bytes] = []
    for i in range(start, len(token_ids) // block_size):
        prev = hash_block(prev, token_ids[i * block_size : (i + 1) * block_size], extra)
        out.append(prev)
    return out
