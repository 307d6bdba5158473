"""The scheduler's configuration: one frozen tree, built at the edge (the CLI)."""

from __future__ import annotations

import msgspec


class SchedulerConfig(msgspec.Struct, frozen=True, kw_only=True):
    # Admission: past this many prompt tokens waiting centrally, new requests get 429.
    max_queued_tokens: int = 262_144
    # A worker silent for this long is removed and its requests are retried or failed.
    worker_expiry_s: float = 2.0
    # Prefill rate assumed before any prefill has been measured (tokens/s, whole fleet
    # per worker); only used to turn a queue length into a Retry-After.
    default_prefill_tokens_per_s: float = 8_000.0
    # How many times a request is re-dispatched after its worker was lost or refused it.
    max_dispatch_attempts: int = 3
    # A session stays bound to the prefill worker that served it this long.
    session_ttl_s: float = 600.0
    # (key, worker) pairs the global prefix index keeps at most (about 100 bytes each).
    index_max_entries: int = 4_000_000

    def __post_init__(self) -> None:
        if self.max_queued_tokens <= 0:
            raise ValueError("max_queued_tokens must be positive")
        if self.worker_expiry_s <= 0:
            raise ValueError("worker_expiry_s must be positive")
        if self.max_dispatch_attempts < 1:
            raise ValueError("max_dispatch_attempts must be at least 1")
