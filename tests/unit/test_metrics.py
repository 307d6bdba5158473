"""ServingMetrics: the per-tenant label set stays bounded whoever sends requests."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from switchyard.observability import ServingMetrics
from switchyard.observability.metrics import OTHER_TENANTS


def tenants_exported(metrics: ServingMetrics) -> set[str]:
    text = metrics.exposition().decode()
    return {
        s.labels["tenant"]
        for family in text_string_to_metric_families(text)
        if family.name == "switchyard_prompt_tokens"
        for s in family.samples
        if s.name == "switchyard_prompt_tokens_total"
    }


def test_the_first_tenants_keep_their_label_and_the_rest_share_one():
    metrics = ServingMetrics(max_tenants=3)
    for tenant in ["a", "b", "a", "c", "d", "e", "b"]:
        metrics.prompt_tokens.labels(metrics.tenant_label(tenant)).inc(10)
    assert tenants_exported(metrics) == {"a", "b", "c", OTHER_TENANTS}
    assert metrics.tenant_label("c") == "c" and metrics.tenant_label("f") == OTHER_TENANTS
