"""The scheduler's configuration: one frozen tree, built at the edge (``switchyard.settings``).

``SchedulerConfig`` is the pure core's; ``SchedulerServiceConfig`` wraps it with what the
bus loop needs."""

from __future__ import annotations

from typing import Annotated

from switchyard.observability import DEFAULT_NATS_URL, NatsClient, NatsClientConfig, NatsUrl
from switchyard.schemas import ConfigStruct, setting


class SchedulerConfig(ConfigStruct, frozen=True, kw_only=True):
    max_queued_tokens: Annotated[
        int, setting("prompt tokens waiting centrally past which new requests get 429", gt=0)
    ] = 262_144
    worker_expiry_s: Annotated[
        float, setting("a worker silent this long is removed; its requests are retried or failed", gt=0)
    ] = 2.0
    # Only used to turn a queue length into a Retry-After before any prefill was measured.
    default_prefill_tokens_per_s: Annotated[
        float, setting("prefill rate assumed per worker before one is measured (tokens/s)", gt=0)
    ] = 8_000.0
    max_dispatch_attempts: Annotated[
        int, setting("dispatches of one request, after its worker was lost (a refusal is not one)", ge=1)
    ] = 3
    refused_retry_s: Annotated[
        float,
        setting(
            "a request the workers refuse (full, though the ledger had room) is tried again, after pauses "
            "from 0.1 s doubling up to 2 s, for this long from its first refusal before it fails",
            gt=0,
        ),
    ] = 30.0
    session_ttl_s: Annotated[float, setting("a session stays bound to its prefill worker this long", gt=0)] = 600.0
    # About 370 bytes for a key held by one worker, 80 more per further holder: 1M pairs is
    # roughly 370 MB.
    index_max_entries: Annotated[int, setting("(key, worker) pairs the global prefix index keeps", gt=0)] = 1_000_000
    snapshot_retry_s: Annotated[float, setting("a worker whose KV snapshot failed is asked again after", gt=0)] = 1.0
    policy: Annotated[
        str,
        setting(
            "prefill placement: round_robin, least_requests, least_tokens, sglang_cache_aware, dynamo_kv, llmd, "
            "llmd_precise, switchyard (prefix: an old name of sglang_cache_aware)"
        ),
    ] = "switchyard"
    fetch_credit: Annotated[
        float, setting("share of recomputing a block that a host/disk/cluster copy saves", ge=0.0, le=1.0)
    ] = 0.8
    session_max_load: Annotated[
        float, setting("a session follows its worker only below this share of the worker's budget", gt=0)
    ] = 0.8
    decode_overcommit: Annotated[
        float,
        setting(
            "requests in flight may claim this multiple of the decode fleet's KV capacity (prompt + max_tokens "
            "each); past it a request gets 429 up front instead of waiting after token 0",
            ge=1.0,
        ),
    ] = 2.0
    default_decode_s: Annotated[
        float, setting("a decode's duration assumed before one is measured (for Retry-After)", gt=0)
    ] = 10.0
    spill_wait_s: Annotated[
        float,
        setting(
            "federation: this region counts as saturated (other regions' ingresses send it no new sessions, "
            "and its own spill them) once its predicted queue time passes this",
            gt=0,
        ),
    ] = 2.0
    local_prefill_max_tokens: Annotated[
        int, setting("prompts with at most this many uncached tokens prefill on their decode worker", ge=0)
    ] = 0
    ttft_slo_s: Annotated[
        float,
        setting(
            "the time to first token requests should meet (0: none). With the switchyard policy, a request "
            "predicted to miss it waits behind every request that can still meet it",
            ge=0.0,
        ),
    ] = 0.0
    tpot_slo_s: Annotated[
        float,
        setting(
            "the time per output token requests should meet (0: none). With the switchyard policy on "
            "colocated workers, some are lent to decoding while decodes run slower than it",
            ge=0.0,
        ),
    ] = 0.0
    backfill_lookahead: Annotated[
        int,
        setting(
            "a prompt over every worker's budget waits for a worker to drain; meanwhile up to this many "
            "requests behind it may go to the other workers (0: none)",
            ge=0,
        ),
    ] = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        from switchyard.scheduler.policies import POLICIES  # here, not at import: policies imports state only

        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose one of {', '.join(sorted(POLICIES))}")


class SchedulerServiceConfig(ConfigStruct, frozen=True, kw_only=True):
    nats_url: NatsUrl = DEFAULT_NATS_URL
    nats_client: NatsClient = NatsClientConfig()
    core: Annotated[SchedulerConfig, setting("the decision core", prefix="")] = SchedulerConfig()
    tick_s: Annotated[float, setting("the scheduler's timer tick", gt=0)] = 0.1
    dispatch_timeout_s: Annotated[float, setting("an unanswered dispatch removes its worker after", gt=0)] = 2.0
    snapshot_timeout_s: Annotated[float, setting("how long to wait for a worker's KV snapshot", gt=0)] = 2.0
    snapshot_fetchers: Annotated[int, setting("KV snapshots fetched at once", ge=1)] = 4
    lease_ttl_s: Annotated[
        float,
        setting(
            "the active scheduler's lease lasts this long unrenewed; a standby takes over within about "
            "this plus --lease-renew-s of the active one dying",
            gt=0,
        ),
    ] = 1.0
    lease_renew_s: Annotated[
        float, setting("the active scheduler renews its lease, and a standby tries to take it, this often", gt=0)
    ] = 0.25
    takeover_settle_s: Annotated[
        float, setting("a scheduler taking over waits at most this long for the workers' roll-call answers", gt=0)
    ] = 0.5
    region: Annotated[
        str, setting("federation: this scheduler's region (it then publishes the region's summary); empty: none")
    ] = ""
    summary_interval_s: Annotated[float, setting("federation: how often the region's summary is published", gt=0)] = 0.5
    standby_shadow_bytes: Annotated[
        int, setting("bytes of submits a standby scheduler keeps, to account for them when it takes over", gt=0)
    ] = 64 << 20

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.lease_renew_s >= self.lease_ttl_s:
            raise ValueError(f"lease_renew_s ({self.lease_renew_s}) must be less than lease_ttl_s ({self.lease_ttl_s})")
