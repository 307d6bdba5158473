"""Content-addressed block keys: the one block-hash implementation of Switchyard.

``key_i = H(key_{i-1}, tokens_i, salt)`` over whole blocks of ``block_size`` tokens.
The salt is per tenant and model, so one tenant's prompt never matches another's
cache entry (no cross-tenant timing side channel). A trailing partial block gets no
key: it cannot be shared until it is full.

``H`` is BLAKE2b-64 over a fixed little-endian layout, so the key of a prefix is
the same in every process and on every run (no ``PYTHONHASHSEED`` dependence).
"""

from __future__ import annotations

import hashlib
import struct
from typing import NewType

BlockKey = NewType("BlockKey", int)  # chained: depends on every token before it
Salt = NewType("Salt", bytes)

ROOT_KEY = BlockKey(0)


def salt_for(tenant: str, model: str) -> Salt:
    return Salt(hashlib.blake2b(f"{tenant}\x00{model}".encode(), digest_size=16).digest())


def hash_block_tokens(parent: BlockKey, tokens: list[int], salt: Salt) -> BlockKey:
    h = hashlib.blake2b(digest_size=8)
    h.update(parent.to_bytes(8, "little"))
    h.update(salt)
    h.update(struct.pack(f"<{len(tokens)}I", *tokens))
    return BlockKey(int.from_bytes(h.digest(), "little"))


def block_keys(tokens: list[int], block_size: int, salt: Salt) -> list[BlockKey]:
    """Chained keys of every full block of ``tokens``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    keys: list[BlockKey] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, tokens[start : start + block_size], salt)
        keys.append(parent)
    return keys
