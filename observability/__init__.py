"""Tracing across bus hops, metrics, and the instrumented bus connection. A leaf package."""

if __name__ != "switchyard.observability":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.observability, not {__name__}")

from switchyard.observability import tracing
from switchyard.observability.bus import (
    DEFAULT_NATS_URL,
    BusAuthError,
    BusClosedError,
    BusStats,
    NatsClient,
    NatsClientConfig,
    NatsUrl,
    connect,
    decoded,
    redacted,
    settle,
    subscribe,
)
from switchyard.observability.metrics import CONTENT_TYPE, EDGE_REFUSAL_REASONS, ServingMetrics
from switchyard.observability.tracing import TracingError

__all__ = [
    "CONTENT_TYPE",
    "DEFAULT_NATS_URL",
    "EDGE_REFUSAL_REASONS",
    "BusAuthError",
    "BusClosedError",
    "BusStats",
    "NatsClient",
    "NatsClientConfig",
    "NatsUrl",
    "ServingMetrics",
    "TracingError",
    "connect",
    "decoded",
    "redacted",
    "settle",
    "subscribe",
    "tracing",
]
