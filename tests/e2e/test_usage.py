"""Usage records through the real HTTP API (``--auth keys``, two tenants) with the official
``openai`` client on the sim engine: one record per request on JetStream, under the tenant
of the key, its tokens those of the response's ``usage`` (cached ones included), the
per-tenant counters on ``/metrics``, and ``switchyard usage``'s summary of it all."""

from __future__ import annotations

import json

import anyio
import httpx
import openai
import pytest

from switchyard import cli
from switchyard import usage as usage_cli
from switchyard.ingress.auth import KeyStore
from switchyard.observability import NatsClientConfig
from tests.support.stack import MODEL, running_stack, wait_until

SHARED = "the system prompt every request of this conversation repeats, word for word; " * 8


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    store = KeyStore(tmp_path_factory.mktemp("auth") / "keys.json")
    secrets = {tenant: store.create(tenant)[1] for tenant in ("acme", "bravo")}
    return secrets | {"path": str(store.path)}


@pytest.fixture(scope="module")
def stack(module_nats, keys):
    overrides = {"auth": "keys", "keys_file": keys["path"], "region": "eu-test"}
    with running_stack(module_nats.url, ingress_overrides=overrides) as stack:
        yield stack


@pytest.fixture(scope="module")
def served(stack, keys) -> dict[str, tuple[str, object]]:
    """Every response, by id, with the tenant whose key asked: acme repeats a long prefix
    (a session, then streamed); bravo's prompts share nothing."""

    def client(tenant: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=stack.base_url, api_key=keys[tenant], max_retries=0, timeout=30)

    acme, bravo = client("acme"), client("bravo")
    responses = []
    for turn in range(3):
        reply = acme.chat.completions.create(
            model=MODEL,
            messages=[{"role": "system", "content": SHARED}, {"role": "user", "content": f"turn {turn}"}],
            max_tokens=4,
            extra_headers={"x-session-affinity": "conversation-1"},
        )
        responses.append(("acme", reply))
    chunks = list(
        acme.completions.create(
            model=MODEL, prompt=SHARED, max_tokens=3, stream=True, stream_options={"include_usage": True}
        )
    )
    responses.append(("acme", chunks[-1]))
    for n in range(2):
        reply = bravo.completions.create(model=MODEL, prompt=f"{n} {'unrelated ' * (20 + n)}", max_tokens=2 + n)
        responses.append(("bravo", reply))
    assert wait_until(lambda: stack.ingress.usage.published >= len(responses), timeout_s=10)
    return {reply.id: (tenant, reply) for tenant, reply in responses}


def records(stack) -> list:
    return anyio.run(usage_cli.read_records, stack.nats_url, NatsClientConfig())


def test_one_record_per_request_with_the_responses_usage(stack, served):
    stored = records(stack)
    assert sorted(r.request_id for r in stored) == sorted(served)
    for record in stored:
        tenant, reply = served[record.request_id]
        spent = reply.usage
        assert record.tenant == tenant and record.outcome == "ok" and record.region == "eu-test"
        assert record.prompt_tokens == spent.prompt_tokens
        assert record.cached_tokens == spent.prompt_tokens_details.cached_tokens
        assert record.completion_tokens == spent.completion_tokens
        assert record.arrived_unix <= (record.first_token_unix or 0) <= record.finished_unix
        assert record.session_affinity == (record.kind == "chat")


def test_a_repeated_prefix_is_served_from_the_cache_and_shows_so(stack, served):
    cached = {t: sum(r.cached_tokens for r in records(stack) if r.tenant == t) for t in ("acme", "bravo")}
    assert cached["acme"] > 0 and cached["bravo"] == 0


def test_the_command_summarises_by_tenant(stack, served, capsys):
    assert cli.main(["usage", "--nats-url", stack.nats_url, "--json"]) == 0
    summary = {row["tenant"]: row for row in json.loads(capsys.readouterr().out)["tenants"]}
    assert set(summary) == {"acme", "bravo"}
    for tenant, row in summary.items():
        mine = [reply.usage for t, reply in served.values() if t == tenant]
        prompt = sum(u.prompt_tokens for u in mine)
        cached = sum(u.prompt_tokens_details.cached_tokens for u in mine)
        assert (row["requests"], row["prompt_tokens"], row["cached_tokens"]) == (len(mine), prompt, cached)
        assert row["completion_tokens"] == sum(u.completion_tokens for u in mine)
        assert row["cached_share"] == round(cached / prompt, 4)


def test_metrics_count_requests_and_records_by_tenant(stack, served):
    text = httpx.get(stack.ingress.url + "/metrics").text
    assert 'switchyard_tenant_requests_total{outcome="ok",tenant="acme"} 4.0' in text
    assert 'switchyard_tenant_requests_total{outcome="ok",tenant="bravo"} 2.0' in text
    assert f"switchyard_usage_records_published_total {float(len(served))}" in text
    assert "switchyard_usage_records_dropped_total 0.0" in text
