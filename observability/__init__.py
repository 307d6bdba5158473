"""Tracing across bus hops, metrics, and the instrumented bus connection. A leaf package."""

if __name__ != "switchyard.observability":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.observability, not {__name__}")

from switchyard.observability import tracing
from switchyard.observability.bus import BusClosedError, BusStats, connect, decoded, subscribe
from switchyard.observability.metrics import CONTENT_TYPE, ServingMetrics
from switchyard.observability.tracing import TracingError

__all__ = [
    "CONTENT_TYPE",
    "BusClosedError",
    "BusStats",
    "ServingMetrics",
    "TracingError",
    "connect",
    "decoded",
    "subscribe",
    "tracing",
]
