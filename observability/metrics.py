"""Prometheus metrics of the serving path, on a registry per process (or per test)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from switchyard.schemas import ClusterStatus, WorkerSummary

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Tenants are the operator's, but every new label value is a new series in Prometheus for as
# long as the process lives: the first MAX_TENANT_LABELS tenants keep their own label and the
# rest share OTHER_TENANTS, which no tenant name can spell (tenants are [A-Za-z0-9._-]).
MAX_TENANT_LABELS = 100
OTHER_TENANTS = "(other)"
# Why the HTTP edge (ingress/edge.py) refused a connection's request before the app saw it.
# Fixed, so each has its series from the start (at 0) and a dashboard query finds it.
EDGE_REFUSAL_REASONS = (
    "headers_too_large",
    "too_many_headers",
    "head_timeout",
    "body_timeout",
    "too_many_connections",
    "slow_reader",
    "idle",
)


class ServingMetrics:
    """What platform teams judge us by: TTFT, TPOT, queue time, tokens and cache hits."""

    def __init__(self, registry: CollectorRegistry | None = None, max_tenants: int = MAX_TENANT_LABELS) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "switchyard_time_to_first_token_seconds",
            "Request arrival at the ingress to its first token.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.tpot = Histogram(
            "switchyard_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            registry=r,
            buckets=_TPOT_BUCKETS,
        )
        self.queue_time = Histogram(
            "switchyard_queue_time_seconds",
            "Time a request waited in the scheduler's central queue.",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        # By tenant, bounded: see tenant_label.
        self.max_tenants = max_tenants
        self._tenants: set[str] = set()
        self.prompt_tokens = Counter(
            "switchyard_prompt_tokens", "Prompt tokens of finished requests.", ["tenant"], registry=r
        )
        self.cached_tokens = Counter(
            "switchyard_cached_tokens",
            "Prompt tokens served from a KV cache instead of computed.",
            ["tenant"],
            registry=r,
        )
        self.generation_tokens = Counter("switchyard_generation_tokens", "Output tokens sent.", ["tenant"], registry=r)
        self.batch_tokens = Counter(
            "switchyard_batch_tokens",
            "Prompt and output tokens of finished batch-priority requests (x-switchyard-priority above 0, as the "
            "batch runner sends them); their rate is the batch's tokens/s.",
            ["kind"],
            registry=r,
        )
        for kind in ("prompt", "completion"):
            self.batch_tokens.labels(kind=kind)
        self.tenant_requests = Counter(
            "switchyard_tenant_requests",
            "Finished requests by tenant and outcome (ok, error, cancelled).",
            ["tenant", "outcome"],
            registry=r,
        )
        # The usage records (ingress/usage.py): published to JetStream, or lost.
        self.usage_published = Counter(
            "switchyard_usage_records_published", "Usage records JetStream stored.", registry=r
        )
        self.usage_dropped = Counter(
            "switchyard_usage_records_dropped",
            "Usage records lost: the buffer was full while JetStream was unreachable, or the ingress stopped first.",
            registry=r,
        )
        self.usage_pending = Gauge(
            "switchyard_usage_records_pending", "Usage records waiting to be published.", registry=r
        )
        self.requests = Counter("switchyard_requests", "Requests by outcome.", ["outcome"], registry=r)
        self.migrations = Counter(
            "switchyard_migrations",
            "Streams whose worker was lost mid-stream, by outcome: resumed on another worker, "
            "refused by the scheduler, or exhausted (max_migrations reached).",
            ["outcome"],
            registry=r,
        )
        for outcome in ("resumed", "refused", "exhausted"):  # a series at 0 before the first
            self.migrations.labels(outcome=outcome)
        self.recomputed_tokens = Counter(
            "switchyard_recomputed_tokens",
            "Prompt and output tokens prefilled again to continue migrated streams, cached ones excluded.",
            registry=r,
        )
        self.edge_refusals = Counter(
            "switchyard_edge_refusals",
            "Requests and connections the HTTP edge refused or dropped, by reason.",
            ["reason"],
            registry=r,
        )
        for reason in EDGE_REFUSAL_REASONS:
            self.edge_refusals.labels(reason=reason)
        self.in_flight = Gauge("switchyard_requests_in_flight", "Requests being generated.", registry=r)
        # Federation (ingress.federation): bounded by the regions of the supercluster.
        self.region_routes = Counter(
            "switchyard_region_routes",
            "Requests this ingress routed, by region and reason: home, session (to the region holding its "
            "prefix), spill (home saturated), blind, local.",
            ["region", "reason"],
            registry=r,
        )
        self.region_alive = Gauge(
            "switchyard_region_alive",
            "1 while the region's summaries arrive, 0 once it is dark.",
            ["region"],
            registry=r,
        )
        self.region_rtt = Gauge(
            "switchyard_region_rtt_seconds",
            "Measured round trip to the region (moving average).",
            ["region"],
            registry=r,
        )
        self.region_lost_streams = Counter(
            "switchyard_region_lost_streams",
            "Streams in flight in a region that went dark (continued elsewhere or failed cleanly).",
            registry=r,
        )
        self.queued_requests = Gauge(
            "switchyard_scheduler_queued_requests",
            "Requests the scheduler holds, by where they wait: prefill (for a prefill worker), decode "
            "(prefilled, for decode room), paused (refused by a full worker, to be placed again).",
            ["stage"],
            registry=r,
        )
        self.queued_tokens = Gauge(
            "switchyard_scheduler_queued_prompt_tokens", "Prompt tokens waiting for a prefill worker.", registry=r
        )
        self.reclaimed_requests = Gauge(
            "switchyard_scheduler_reclaimed_requests",
            "Requests the scheduler forgot since it started because their worker no longer held them and "
            "the message saying how they ended was lost (a NATS restart, a slow consumer): budget otherwise stranded.",
            registry=r,
        )
        self.strays_cancelled = Gauge(
            "switchyard_scheduler_strays_cancelled",
            "Runs cancelled since the scheduler started because a worker still held them after they had ended "
            "(their cancel was lost while the worker reconnected).",
            registry=r,
        )
        self.strays_ignored = Gauge(
            "switchyard_scheduler_strays_ignored",
            "Runs a worker named in an audit's answer that this scheduler never placed there: neither cancelled "
            "nor adopted.",
            registry=r,
        )
        self.session_bindings = Gauge(
            "switchyard_scheduler_session_bindings", "Session bindings the scheduler holds.", registry=r
        )
        self.sessions_dropped = Gauge(
            "switchyard_scheduler_sessions_dropped",
            "Session bindings dropped since the scheduler started because their worker is gone.",
            registry=r,
        )
        self.abandoned_handoffs = Gauge(
            "switchyard_scheduler_abandoned_handoffs",
            "Prefilled requests that ended before a decode worker took their KV, since the scheduler started.",
            registry=r,
        )
        self.stream_refused = Gauge(
            "switchyard_stream_refused_chunks",
            "Token chunks refused since start: sent by a worker the scheduler never assigned to their request.",
            registry=r,
        )
        self.bus_dropped = Gauge(
            "switchyard_bus_dropped_messages", "Messages a slow NATS subscription of this process dropped.", registry=r
        )

        # Each worker's engine counters, as its last heartbeat told the scheduler; the
        # ingress reads them at scrape time (a vLLM engine's own figures, not ours).
        workers = ["worker_id", "role", "engine"]
        self.worker_boot = Gauge(
            "switchyard_worker_boot_seconds", "How long the worker's engine took to start.", workers, registry=r
        )
        self.worker_tokens = Gauge(
            "switchyard_worker_prompt_tokens",
            "Prompt tokens the worker's engine saw, by source (computed, local_cache_hit, external_kv_transfer).",
            [*workers, "source"],
            registry=r,
        )
        self.worker_kv_fallbacks = Gauge(
            "switchyard_worker_kv_fallbacks",
            "Handed-over KV that did not arrive, so the engine recomputed it.",
            workers,
            registry=r,
        )
        self.worker_spec = Gauge(
            "switchyard_worker_spec_decode_tokens",
            "Speculative decoding: draft tokens proposed and accepted.",
            [*workers, "kind"],
            registry=r,
        )
        self.worker_spec_acceptance = Gauge(
            "switchyard_worker_spec_decode_acceptance_ratio",
            "Accepted over proposed draft tokens.",
            workers,
            registry=r,
        )

    def tenant_label(self, tenant: str) -> str:
        """``tenant`` as the value of a ``tenant`` label: itself while the label set has room."""
        if tenant in self._tenants:
            return tenant
        if len(self._tenants) < self.max_tenants:
            self._tenants.add(tenant)
            return tenant
        return OTHER_TENANTS

    def set_queues(self, status: ClusterStatus) -> None:
        """What waits at the scheduler, by stage."""
        self.queued_requests.labels(stage="prefill").set(status.queued_requests)
        self.queued_requests.labels(stage="decode").set(status.awaiting_decode)
        self.queued_requests.labels(stage="paused").set(status.paused_requests)
        self.queued_tokens.set(status.queued_tokens)

    def set_stranded(self, status: ClusterStatus) -> None:
        """What the scheduler says of state that could have outlived its request."""
        self.reclaimed_requests.set(status.reclaimed_requests)
        self.strays_cancelled.set(status.strays_cancelled)
        self.strays_ignored.set(status.strays_ignored)
        self.session_bindings.set(status.session_bindings)
        self.sessions_dropped.set(status.sessions_dropped)
        self.abandoned_handoffs.set(status.abandoned_handoffs)

    def set_workers(self, summaries: Iterable[WorkerSummary]) -> None:
        """Replace the per-worker gauges with ``ClusterStatus.workers``."""
        for gauge in (
            self.worker_boot,
            self.worker_tokens,
            self.worker_kv_fallbacks,
            self.worker_spec,
            self.worker_spec_acceptance,
        ):
            gauge.clear()
        for w in summaries:
            labels = (w.worker_id, w.role, w.engine)
            self.worker_boot.labels(*labels).set(w.boot_s)
            stats = w.stats
            if stats is None:
                continue
            for source, value in (
                ("computed", stats.computed_tokens),
                ("local_cache_hit", stats.local_cache_hit_tokens),
                ("external_kv_transfer", stats.external_hit_tokens),
            ):
                self.worker_tokens.labels(*labels, source).set(value)
            self.worker_kv_fallbacks.labels(*labels).set(stats.kv_fallbacks)
            if stats.spec_draft_tokens:
                self.worker_spec.labels(*labels, "draft").set(stats.spec_draft_tokens)
                self.worker_spec.labels(*labels, "accepted").set(stats.spec_accepted_tokens)
                self.worker_spec_acceptance.labels(*labels).set(stats.spec_accepted_tokens / stats.spec_draft_tokens)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
