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
    # (key, worker) pairs the global prefix index keeps at most (about 370 bytes for a
    # key held by one worker, 80 more per further holder: 1M pairs is roughly 370 MB).
    index_max_entries: int = 1_000_000
    # A worker whose snapshot failed is asked again after this long.
    snapshot_retry_s: float = 1.0
    # Prefill placement policy: round_robin, least_requests, least_tokens, prefix, switchyard.
    policy: str = "switchyard"
    # A block on a worker's host/disk tier or in the cluster store saves this share of
    # recomputing it (fetching is not free).
    fetch_credit: float = 0.8
    # A session goes back to its worker only while that worker stays under this share
    # of its token budget; past it, the request spills to the policy.
    session_max_load: float = 0.8
    # Conditional disaggregation: a prompt with at most this many uncached tokens is
    # prefilled by its decode worker (0: never).
    local_prefill_max_tokens: int = 0

    def __post_init__(self) -> None:
        if self.max_queued_tokens <= 0:
            raise ValueError("max_queued_tokens must be positive")
        if self.worker_expiry_s <= 0:
            raise ValueError("worker_expiry_s must be positive")
        if self.max_dispatch_attempts < 1:
            raise ValueError("max_dispatch_attempts must be at least 1")
        if not 0.0 <= self.fetch_credit <= 1.0:
            raise ValueError("fetch_credit must be within [0, 1]")
        if self.session_max_load <= 0 or self.local_prefill_max_tokens < 0:
            raise ValueError("session_max_load must be positive, local_prefill_max_tokens not negative")
        from switchyard.scheduler.policies import POLICIES  # here, not at import: policies imports state only

        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")
