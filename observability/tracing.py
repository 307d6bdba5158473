"""OpenTelemetry across bus hops: one request is one trace.

The W3C ``traceparent`` travels in NATS message headers. Each service calls
``configure`` once at its edge; libraries only ask for ``tracer()``.
Exporters: ``none`` (the default; spans are still created so context propagates),
``console``, or ``otlp`` (needs the ``otlp`` extra and OTEL_EXPORTER_OTLP_ENDPOINT).
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from switchyard.schemas import SwitchyardError

EXPORTERS = ("none", "console", "otlp")


class TracingError(SwitchyardError):
    """The tracing configuration asked for something this install cannot do."""


def configure(
    service_name: str, exporter: str = "none", processor: SpanProcessor | None = None
) -> TracerProvider | None:
    """Install the process's tracer provider (OpenTelemetry allows one per process).

    With nothing to export, no SDK provider is installed: the API's non-recording spans
    still carry the incoming context onward, so traces stay whole across services that
    do export, and the hot path pays nothing for spans nobody reads."""
    if exporter == "none" and processor is None:
        return None
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if processor is not None:
        provider.add_span_processor(processor)
    exp = _exporter(exporter)
    if exp is not None:
        provider.add_span_processor(BatchSpanProcessor(exp))
    trace.set_tracer_provider(provider)
    return provider


def _exporter(name: str) -> SpanExporter | None:
    if name == "none":
        return None
    if name == "console":
        return ConsoleSpanExporter()
    if name == "otlp":
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError as exc:
            raise TracingError("exporter 'otlp' needs: pip install 'switchyard[otlp]'") from exc
        return OTLPSpanExporter()
    raise TracingError(f"unknown trace exporter {name!r}; choose one of {', '.join(EXPORTERS)}")


def tracer() -> trace.Tracer:
    return trace.get_tracer("switchyard")


def inject(ctx: otel_context.Context | None = None) -> dict[str, str]:
    """Headers carrying ``ctx`` (default: the current context)."""
    headers: dict[str, str] = {}
    propagate.inject(headers, context=ctx)
    return headers


def extract(headers: Mapping[str, str] | None) -> otel_context.Context:
    return propagate.extract(dict(headers or {}))
