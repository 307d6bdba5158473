"""Tracing across bus hops, metrics, and the instrumented bus connection. A leaf package."""

if __name__ != "switchyard.observability":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.observability, not {__name__}")

from switchyard.observability import tracing
from switchyard.observability.bus import (
    BusAuthError,
    BusClosedError,
    BusStats,
    NatsClientConfig,
    connect,
    decoded,
    redacted,
    subscribe,
)
from switchyard.observability.metrics import CONTENT_TYPE, ServingMetrics
from switchyard.observability.tracing import TracingError

__all__ = [
    "CONTENT_TYPE",
    "BusAuthError",
    "BusClosedError",
    "BusStats",
    "NatsClientConfig",
    "ServingMetrics",
    "TracingError",
    "connect",
    "decoded",
    "redacted",
    "subscribe",
    "tracing",
]
