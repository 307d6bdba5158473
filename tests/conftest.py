"""Shared fixtures: a real nats-server per test (or per module, for a shared stack)."""

from __future__ import annotations

import os

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.observability import tracing
from switchyard.procs import nats_server

SPANS = InMemorySpanExporter()
# One tracer provider per process (OpenTelemetry's rule): installed once, for every test.
tracing.configure("switchyard-tests", "none", processor=SimpleSpanProcessor(SPANS))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SWITCHYARD_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a GPU: set SWITCHYARD_GPU=1 on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
def nats():
    """A private nats-server on a free loopback port, for this test only."""
    with nats_server() as server:
        yield server


@pytest.fixture(scope="module")
def module_nats():
    with nats_server() as server:
        yield server


@pytest.fixture
def spans():
    SPANS.clear()
    return SPANS
