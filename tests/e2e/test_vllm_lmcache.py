"""Real vLLM engines with KV handed over through LMCache (its CPU and disk tiers, the
Mooncake Store as its remote tier, and our CPU KV adapter, ``switchyard.kvbus.lmcache_cpu``), and
n-gram speculative decoding on the decode pool, through the real HTTP API.

- greedy output through prefill -> decode (speculating) equals one engine alone: neither
  the handoff nor speculation changes a greedy token, and the decode engine loaded the
  handed-over blocks (the stock LMCache connector would silently recompute on CPU);
- a shared prefix reports its whole blocks as cached, the prefill engine computing only the rest;
- speculation's acceptance is counted and exported; LMCache's disk tier is written;
- with the Mooncake segment dead, requests complete by recomputing, counted.
"""

from __future__ import annotations

import random

import httpx
import pytest

from tests.support.stack import wait_until
from tests.support.vllm_stack import (
    BLOCK,
    MAX_TOKENS,
    UpStack,
    assert_greedy_matches_reference,
    settled_stats,
    vllm_stack,
)

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

PREFIX = [random.Random(12).randrange(256, 4000) for _ in range(8 * BLOCK + 9)]


@pytest.fixture(scope="module")
def disk(tmp_path_factory):
    return tmp_path_factory.mktemp("lmcache-disk")


@pytest.fixture(scope="module")
def stack(module_nats, tmp_path_factory, disk) -> UpStack:
    extra = ["--lmcache-disk-dir", str(disk), "--speculative-method", "ngram", "--num-speculative-tokens", "3"]
    with vllm_stack(
        module_nats.url, tmp_path_factory.mktemp("vllm") / "up.log", kv_transfer="lmcache", extra=extra
    ) as s:
        yield s


def test_greedy_output_through_lmcache_and_speculation_is_one_engines_output(references, client, bus, tokenizer):
    assert_greedy_matches_reference(client, bus, tokenizer, references)


def test_speculation_is_counted_and_exported(stack, client, bus):
    stats = settled_stats(bus, "decode")
    assert stats.spec_draft_tokens > 0, "the n-gram proposer never proposed"
    assert 0 < stats.spec_accepted_tokens <= stats.spec_draft_tokens
    text = httpx.get(stack.url + "/metrics", timeout=5).text
    ratio = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("switchyard_worker_spec_decode_acceptance_ratio{")
    ]
    assert len(ratio) == 1 and 0 < ratio[0] <= 1
    assert 'switchyard_worker_spec_decode_tokens{engine="vllm",kind="accepted",role="decode"' in text


def test_shared_prefix_is_reported_cached_and_the_disk_tier_written(client, bus, disk):
    client.completions.create(model="tiny-llama", prompt=[*PREFIX, 300], max_tokens=2, temperature=0)
    before = settled_stats(bus, "prefill")
    second = client.completions.create(model="tiny-llama", prompt=[*PREFIX, 400, 401], max_tokens=2, temperature=0)
    shared = len(PREFIX) // BLOCK * BLOCK
    assert second.usage.prompt_tokens_details.cached_tokens == shared
    after = settled_stats(bus, "prefill", more_than=before.prompt_tokens)
    assert after.computed_tokens - before.computed_tokens == len(PREFIX) + 2 - shared
    assert wait_until(lambda: any(p.is_file() for p in disk.rglob("*")), 10), "nothing on LMCache's disk tier"


def test_one_tenant_never_loads_anothers_kv(client, references):
    """LMCache keys chunks by tokens alone; the worker tags each request with its tenant's
    salt, so a prompt another tenant computed is computed again, not served."""
    prompt = references["prompts"][3]  # served to the default tenant above
    other = client.with_options(default_headers={"x-switchyard-tenant": "other-tenant"}).completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0
    )
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK


def test_a_dead_mooncake_segment_means_recompute_not_failure(stack, client, bus, references, tokenizer):
    (segment,) = stack.children("mooncake_client")
    segment.kill()
    segment.wait(10)
    prompt, expected = references["prompts"][2], references["outputs"][2]
    response = client.with_options(default_headers={"x-switchyard-tenant": "segment-test"}).completions.create(
        model="tiny-llama", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
    )
    assert response.choices[0].text == tokenizer.decode(expected["tokens"])
    assert wait_until(lambda: response.id in bus.finished(), 5)
    finished = bus.finished()[response.id]
    assert finished.kv_loaded_tokens < finished.kv_expected_tokens
    assert wait_until(lambda: settled_stats(bus, "decode").kv_fallbacks >= 1, 10)
