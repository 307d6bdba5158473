"""Shared fixtures: a real nats-server per test (or per module, for a shared stack)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from switchyard.observability import tracing
from switchyard.procs import nats_server

DATA_DIR_ENV = "SWITCHYARD_DATA_DIR"  # up's --data-dir
SPANS = InMemorySpanExporter()
# One tracer provider per process (OpenTelemetry's rule): installed once, for every test.
tracing.configure("switchyard-tests", "none", processor=SimpleSpanProcessor(SPANS))


def pytest_collection_modifyitems(config, items):
    """The vLLM modules first: under ``make test`` (``pytest -n 2``) they are the longest
    run, so they start at once. GPU tests are skipped unless ``SWITCHYARD_GPU=1``."""
    vllm = [item for item in items if item.get_closest_marker("vllm")]
    if vllm:
        items[:] = vllm + [item for item in items if not item.get_closest_marker("vllm")]
    if os.environ.get("SWITCHYARD_GPU") == "1":
        return
    skip = pytest.mark.skip(reason="needs a GPU: set SWITCHYARD_GPU=1 on a GPU host")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_xdist_make_scheduler(config, log):
    """``pytest -n N`` (``make test``): each test module runs whole in one process, so its
    module-scoped stack starts once, and the vLLM modules (``test_vllm_*.py``) one after the
    other in the same process: two vLLM stacks at once would share the Mooncake connector's
    lookup socket and starve each other on two cores. Modules go out in collection order
    (``--no-loadscope-reorder``), the vLLM ones first."""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "vllm" if module.rsplit("/", 1)[-1].startswith("test_vllm_") else module

    return ByModule(config, log)


@contextmanager
def _data_dir(folder) -> Iterator[None]:
    before = os.environ.get(DATA_DIR_ENV)
    os.environ[DATA_DIR_ENV] = str(folder)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(DATA_DIR_ENV, None)
        else:
            os.environ[DATA_DIR_ENV] = before


# Every `switchyard up` a test starts keeps its JetStream store in a fresh folder (one per
# module for a module's stack, one per test inside it), never the user's data folder.
@pytest.fixture(scope="module", autouse=True)
def _module_data_dir(tmp_path_factory):
    with _data_dir(tmp_path_factory.mktemp("data")):
        yield


@pytest.fixture(autouse=True)
def _test_data_dir(tmp_path_factory):
    with _data_dir(tmp_path_factory.mktemp("data")):
        yield


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
    """The spans finished from here on. A span of an earlier test's request may still end after
    this (its generation cleans up after the client has its response): ``cleared_at`` (ns, the
    clock spans start by) lets a test take only the spans that started in it."""
    SPANS.clear()
    SPANS.cleared_at = time.time_ns()  # type: ignore[attr-defined]
    return SPANS
