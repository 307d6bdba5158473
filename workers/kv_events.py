"""A worker's KV cache, as the scheduler's prefix index hears of it.

An engine that keeps a prefix cache implements ``KvCacheView``: it collects what it
stored and evicted since it was last asked, and lists everything it holds. The
worker's ``KvReporter`` turns the changes into ``KvEventBatch``es numbered 1, 2, 3...
(published by the role after each engine batch, only when something changed) and
answers snapshot requests with ``KvSnapshot(seq=the last batch numbered)``.

Why a snapshot and the batch stream agree without a lock: the reporter numbers a batch
in the same synchronous step that takes its changes, and reads the cache in one
synchronous step too. So a snapshot never misses a numbered batch's changes; at worst
it already shows changes of the next batch, and applying that batch on top changes
nothing (each event sets a block present or absent). A batch numbered before a
snapshot but published after it has ``seq <= snapshot.seq``: the index ignores it.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from switchyard.schemas import KvEvent, KvEventBatch, KvSnapshot, Tier


@runtime_checkable
class KvCacheView(Protocol):
    """What an engine tells of its KV cache (``SimEngine`` implements it; ``vllm`` will
    bridge its own KV events here)."""

    def cached_blocks(self) -> dict[Tier, list[int]]:
        """Every block key held now, per tier."""
        ...

    def take_kv_events(self) -> list[KvEvent]:
        """The changes since the last call (net: bounded by the cache's size), then forgets them."""
        ...


@runtime_checkable
class PushedKvCache(KvCacheView, Protocol):
    """A cache whose changes arrive on the engine's own time (vLLM's KV events): the
    runtime publishes them when they come."""

    async def wait_kv_changes(self) -> None: ...


class NoKvCache:
    """An engine side without a prefix cache (a decode worker): holds nothing, ever."""

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return {}

    def take_kv_events(self) -> list[KvEvent]:
        return []


class KvReporter:
    """One worker's KV event stream: per-worker seq from 1, and snapshots consistent with it."""

    def __init__(self, worker_id: str, cache: KvCacheView) -> None:
        self.worker_id = worker_id
        self.cache = cache
        self.seq = 0  # the last batch numbered

    def next_batch(self) -> KvEventBatch | None:
        """The changes since the last batch, numbered; None when nothing changed."""
        events = self.cache.take_kv_events()
        if not events:
            return None
        self.seq += 1
        return KvEventBatch(worker_id=self.worker_id, seq=self.seq, events=events)

    def snapshot(self) -> KvSnapshot:
        blocks: dict[str, list[int]] = {tier: keys for tier, keys in self.cache.cached_blocks().items()}
        return KvSnapshot(worker_id=self.worker_id, seq=self.seq, blocks=blocks)
