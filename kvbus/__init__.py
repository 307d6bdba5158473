"""Content-addressed KV blocks: keys (Switchyard's own, or a vLLM engine's), and the
KV-transfer settings of the vLLM engine (Mooncake Store, LMCache)."""

if __name__ != "switchyard.kvbus":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.kvbus, not {__name__}")

from switchyard.kvbus.keys import (
    VLLM_DEFAULT_HASH_SEED,
    BlockKey,
    KeyScheme,
    Salt,
    block_keys,
    cache_salt_for,
    hash_block_tokens,
    key_of_digest,
    salt_for,
    vllm_block_hashes,
)
from switchyard.kvbus.lmcache_config import lmcache_environment, lmcache_transfer_config

__all__ = [
    "VLLM_DEFAULT_HASH_SEED",
    "BlockKey",
    "KeyScheme",
    "Salt",
    "block_keys",
    "cache_salt_for",
    "hash_block_tokens",
    "key_of_digest",
    "lmcache_environment",
    "lmcache_transfer_config",
    "salt_for",
    "vllm_block_hashes",
]
