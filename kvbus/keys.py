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


# --- vLLM's own block hashes --------------------------------------------------------
#
# A vLLM engine names its blocks ``sha256(cbor((parent, tuple(tokens), extra_keys)))``
# (``prefix_caching_hash_algo="sha256_cbor"``), chained from a root that is the hash of
# a seed: ``PYTHONHASHSEED`` when set, else the fixed string below. The tenant salt
# enters as vLLM's ``cache_salt`` on the first block only. When the workers run vLLM,
# the ingress computes the very same hashes, so the scheduler's prefix index, the
# engine's KV events and the Mooncake Store's keys all name a block alike. The bus key
# is the digest's low 64 bits read big-endian, which is how vLLM's own KV events shorten
# it by default (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``).

VLLM_DEFAULT_HASH_SEED = "vllm-none-hash"


def cache_salt_for(tenant: str, model: str) -> str:
    """The ``cache_salt`` a vLLM worker gives the engine (and the ingress hashes with)."""
    return salt_for(tenant, model).hex()


def key_of_digest(digest: bytes) -> BlockKey:
    """The bus key of a vLLM block hash: its low 64 bits, as vLLM's KV events give it."""
    return BlockKey(int.from_bytes(digest, "big") & (2**64 - 1))


def _sha256_cbor(value: object) -> bytes:
    import cbor2  # vLLM's own serializer; imported only when vLLM hashes are in use

    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def vllm_block_hashes(
    tokens: list[int], block_size: int, cache_salt: str | None = None, seed: str = VLLM_DEFAULT_HASH_SEED
) -> list[bytes]:
    """vLLM's chained ``sha256_cbor`` hashes of every full block of ``tokens``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    parent = _sha256_cbor(seed)
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        extra = (("cache_salt", cache_salt),) if start == 0 and cache_salt else None
        parent = _sha256_cbor((parent, tuple(tokens[start : start + block_size]), extra))
        hashes.append(parent)
    return hashes


class KeyScheme:
    """How block keys are computed: ``blake2b`` (Switchyard's own, for the sim engine) or
    ``vllm-sha256-cbor`` (a vLLM engine's, with its hash seed)."""

    NAMES = ("blake2b", "vllm-sha256-cbor")

    def __init__(self, name: str = "blake2b", seed: str = VLLM_DEFAULT_HASH_SEED) -> None:
        if name not in self.NAMES:
            raise ValueError(f"unknown block key scheme {name!r}; choose one of {', '.join(self.NAMES)}")
        self.name = name
        self.seed = seed

    def keys(self, tokens: list[int], block_size: int, tenant: str, model: str) -> list[BlockKey]:
        if self.name == "blake2b":
            return block_keys(tokens, block_size, salt_for(tenant, model))
        hashes = vllm_block_hashes(tokens, block_size, cache_salt_for(tenant, model), self.seed)
        return [key_of_digest(h) for h in hashes]
