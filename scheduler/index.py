"""The global prefix index: which worker holds which prefix, on which tier.

Fed by the workers' KV events (``KvEventBatch``, per-worker ``seq``) and snapshots
(``KvSnapshot``, on join and after a gap). Pure data structure: no I/O, no clock.

Contract (what the scheduler core relies on):
- ``apply(batch)`` applies a batch whose seq is exactly the worker's last + 1 and
  returns True; on a gap (or a worker never snapshotted) it applies nothing and
  returns False: the caller must ask that worker for a snapshot.
- ``load_snapshot(snapshot)`` replaces everything known of that worker.
- ``match(block_keys)`` returns, per worker holding at least the first block, how many
  leading blocks it holds on its device tier and how many on any tier (a ``cluster``
  block counts for every worker), in time linear in the blocks matched.
- Memory is bounded by ``max_entries`` (key, worker) pairs; past it, the least recently
  stored or matched keys are dropped (the index may then under-report, never over-report).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from schemas import KvEventBatch, KvSnapshot


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    worker_id: str
    device_blocks: int  # leading blocks on the worker's own device tier
    blocks: int  # leading blocks reachable by it on any tier (device, host, disk, cluster)


class PrefixIndex:
    # PLACEHOLDER (being replaced): knows nothing, so every prompt looks uncached.
    def __init__(self, max_entries: int = 4_000_000) -> None:
        self.max_entries = max_entries

    def apply(self, batch: KvEventBatch) -> bool:
        return True

    def load_snapshot(self, snapshot: KvSnapshot) -> None:
        pass

    def forget_worker(self, worker_id: str) -> None:
        pass

    def knows(self, worker_id: str) -> bool:
        return False

    def match(self, block_keys: list[int], workers: Iterable[str] | None = None) -> dict[str, WorkerMatch]:
        return {}

    @property
    def entries(self) -> int:
        return 0

    def approx_bytes(self) -> int:
        return 0
