"""Content-addressed KV blocks: keys now; handles, tiered stores and KV events to come."""

from kvbus.keys import BlockKey, Salt, block_keys, hash_block_tokens, salt_for

__all__ = ["BlockKey", "Salt", "block_keys", "hash_block_tokens", "salt_for"]
