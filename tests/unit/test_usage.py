"""Usage records without a bus: the record's wire form and its evolution, how a finished
generation becomes one, the subject per tenant, the ingress's rights, and the summary
``switchyard usage`` prints."""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from switchyard import usage as usage_cli
from switchyard.ingress.config import IngressConfig, UsageConfig
from switchyard.ingress.usage import UsageRecorder, usage_record
from switchyard.observability import ServingMetrics
from switchyard.schemas import UsageRecord, permissions, subjects, usage


def full_record(**changes) -> UsageRecord:
    """Every field away from its default, so a field the codec lost would show."""
    fields = {
        "request_id": "chatcmpl-1",
        "tenant": "acme",
        "model": "m",
        "kind": "completion",
        "outcome": "cancelled",
        "prompt_tokens": 120,
        "cached_tokens": 96,
        "completion_tokens": 7,
        "arrived_unix": 1.5,
        "finished_unix": 3.25,
        "first_token_unix": 2.0,
        "region": "eu-west",
        "ingress_id": "ingress-1",
        "session_affinity": True,
        "migrations": 1,
    }
    return UsageRecord(**(fields | changes))


def test_a_record_round_trips_with_every_field_set():
    record = full_record()
    defaults = UsageRecord(**{f: getattr(record, f) for f in UsageRecord.__struct_fields__[:10]})
    assert all(getattr(record, f) != getattr(defaults, f) for f in UsageRecord.__struct_fields__[10:])
    assert usage.decode(usage.encode(record)) == record


def test_a_reader_skips_fields_it_does_not_know():
    body = msgspec.json.decode(usage.encode(full_record()))
    assert usage.decode(msgspec.json.encode(body | {"a_later_field": [1, 2]})) == full_record()


def test_a_record_is_frozen():
    with pytest.raises(AttributeError):
        full_record().tenant = "other"  # type: ignore[misc]


def test_each_tenant_has_its_own_subject_under_the_streams():
    assert subjects.usage("acme") == "sy.v1.usage.acme"
    assert subjects.usage("team.eu-1") == "sy.v1.usage.team~eu-1"  # one token, whatever the tenant
    assert subjects.every_usage() == "sy.v1.usage.>"


def test_the_ingress_may_write_records_and_create_the_stream_only():
    rights = permissions.ingress()
    assert subjects.every_usage() in rights.publish
    # the Files and Batch APIs' own, and the federation's session directory
    others = {*permissions.file_store(), *permissions.batch_ingress(), *permissions.federated_ingress()}
    jetstream = [s for s in rights.publish if s.startswith("$JS") and s not in others]
    assert jetstream == [f"$JS.API.STREAM.CREATE.{usage.STREAM}"]
    assert not [s for s in others if usage.STREAM in s]
    assert not [s for s in rights.subscribe if s.startswith("sy.v1.usage")]


def generation(first_token_after_s: float | None, **spec) -> SimpleNamespace:
    """What ``usage_record`` reads of an ``ingress.generation.Generation``."""
    now = time.monotonic()
    usage_dict = {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "total_tokens": 43,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    return SimpleNamespace(
        spec=SimpleNamespace(**({"request_id": "chatcmpl-9", "tenant": "acme", "session": None} | spec)),
        model="switchyard-sim",
        kind="chat",
        usage=lambda: usage_dict,
        arrived=now - 2.0,
        first_token_at=None if first_token_after_s is None else now - 2.0 + first_token_after_s,
        migrations=0,
    )


def test_a_generation_becomes_the_record_of_its_response_usage():
    before = time.time()
    record = usage_record(generation(0.5, session="conv-1"), "ok", ingress_id="ingress-1", region="eu")  # type: ignore[arg-type]
    assert (record.request_id, record.tenant, record.model, record.kind) == (
        "chatcmpl-9",
        "acme",
        "switchyard-sim",
        "chat",
    )
    assert (record.prompt_tokens, record.cached_tokens, record.completion_tokens) == (40, 32, 3)
    assert record.region == "eu" and record.session_affinity and record.outcome == "ok"
    assert before <= record.finished_unix <= time.time()
    assert record.finished_unix - record.arrived_unix == pytest.approx(2.0, abs=0.1)
    assert record.first_token_unix is not None
    assert record.first_token_unix - record.arrived_unix == pytest.approx(0.5, abs=0.1)


def test_no_region_no_first_token_and_an_unsettled_ending():
    record = usage_record(generation(None), "unsettled", ingress_id="i", region="")  # type: ignore[arg-type]
    assert record.region is None and record.first_token_unix is None and not record.session_affinity
    assert record.outcome == "error"


@pytest.mark.parametrize(
    ("text", "seconds"), [("90s", 90), ("15m", 900), ("1h30m", 5400), ("7d", 604800), ("0.5h", 1800)]
)
def test_durations(text, seconds):
    assert usage_cli.duration(text) == seconds


@pytest.mark.parametrize("text", ["", "15", "m", "1h 30m", "-5m", "1w", "5mm"])
def test_what_is_no_duration(text):
    with pytest.raises(argparse.ArgumentTypeError):
        usage_cli.duration(text)


def test_the_summary_counts_each_request_once_and_shows_the_cached_share():
    records = [
        full_record(request_id="a", tenant="zeta", prompt_tokens=100, cached_tokens=25, completion_tokens=1),
        full_record(request_id="b", tenant="alpha", prompt_tokens=0, cached_tokens=0, completion_tokens=0),
        full_record(request_id="a", tenant="zeta", prompt_tokens=100, cached_tokens=25, completion_tokens=1),
        full_record(request_id="c", tenant="zeta", prompt_tokens=300, cached_tokens=275, completion_tokens=4),
    ]
    summary = usage_cli.summarise(records)
    assert [(u.tenant, u.requests, u.prompt_tokens, u.cached_tokens) for u in summary.tenants] == [
        ("alpha", 1, 0, 0),
        ("zeta", 2, 400, 300),
    ]
    assert summary.tenants[0].cached_share == 0.0 and summary.tenants[1].cached_share == 0.75
    assert (summary.total.requests, summary.total.completion_tokens, summary.duplicates) == (3, 5, 1)
    lines = usage_cli.table(summary).splitlines()
    head = "tenant  requests  prompt tokens  cached tokens  cached share  completion tokens"
    assert lines[0].split() == head.split()
    assert lines[2].split() == ["zeta", "2", "400", "300", "75.0%", "5"]
    assert lines[-1] == "(1 duplicate records skipped)"


def test_requests_are_counted_by_tenant_with_a_bounded_label_set_and_buffered():
    metrics = ServingMetrics(max_tenants=2)
    recorder = UsageRecorder(None, IngressConfig(usage=UsageConfig(buffer=3)), metrics)  # type: ignore[arg-type]
    for n, tenant in enumerate(["a", "b", "c", "a", "d"]):
        recorder.on_finished(generation(0.1, tenant=tenant, request_id=f"r-{n}"), "ok" if n else "weird")  # type: ignore[arg-type]
    samples = {
        (s.labels["tenant"], s.labels["outcome"]): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        if family.name == "switchyard_tenant_requests"
        for s in family.samples
        if s.name.endswith("_total")
    }
    assert samples == {("a", "error"): 1, ("b", "ok"): 1, ("(other)", "ok"): 2, ("a", "ok"): 1}
    assert recorder.dropped == 2  # a buffer of 3, nobody publishing
    assert "switchyard_usage_records_pending 3.0" in metrics.exposition().decode()
