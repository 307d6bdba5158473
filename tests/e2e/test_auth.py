"""API keys through the real HTTP API (``--auth keys``) with the official ``openai`` client:
who may call, as which tenant, how much; and the cache oracle of a spoofed tenant closed."""

from __future__ import annotations

import httpx
import openai
import pytest

from switchyard.ingress.auth import KeyStore, Limits
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, running_stack, wait_until

PROMPT = "a tenant's private system prompt " * 40


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, str]:
    store = KeyStore(tmp_path_factory.mktemp("auth") / "keys.json")
    made = {
        "alice": store.create("acme"),
        "mallory": store.create("evil"),
        "proxy": store.create("front", trusted_proxy=True),
        "rpm": store.create("r", Limits(rpm=2)),
        "tpm": store.create("t", Limits(tpm=100)),
        "streams": store.create("s", Limits(max_streams=1)),
        "doomed": store.create("d"),
    }
    secrets = {name: secret for name, (_, secret) in made.items()}
    secrets["path"] = str(store.path)
    secrets["doomed-id"] = made["doomed"][0].key_id
    return secrets


@pytest.fixture(scope="module")
def stack(module_nats, keys):
    # A decode step of 5 ms: a long stream stays open long enough to be counted.
    with running_stack(
        module_nats.url,
        decode_cost=SimCostModel(decode_step_base_s=0.005),
        ingress_overrides={"auth": "keys", "keys_file": keys["path"]},
    ) as stack:
        yield stack


def client(stack, secret: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=secret, max_retries=0, timeout=30)


def complete(stack, secret: str, prompt: str = "hello", max_tokens: int = 2, **kwargs):
    return client(stack, secret).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **kwargs)


def assert_openai_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    return error


def test_a_key_is_served(stack, keys):
    assert complete(stack, keys["alice"]).usage.completion_tokens == 2
    assert [m.id for m in client(stack, keys["alice"]).models.list().data] == [MODEL]
    assert httpx.get(stack.ingress.url + "/health").status_code == 200  # probes need no key


def test_no_key_or_a_wrong_one_is_401_before_the_body_is_read(stack, keys):
    # Not even JSON: a 400 would mean the body was parsed for a caller nobody knows.
    response = httpx.post(stack.base_url + "/completions", content=b"{nope")
    assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"].startswith("Bearer")
    with pytest.raises(openai.AuthenticationError):
        complete(stack, keys["alice"][:-2] + "zz")
    with pytest.raises(openai.AuthenticationError):
        complete(stack, "sk-proj-somebody-elses")


def test_a_revoked_key_is_refused_within_seconds(stack, keys):
    complete(stack, keys["doomed"])
    KeyStore(keys["path"]).revoke(keys["doomed-id"])

    def refused() -> bool:
        try:
            complete(stack, keys["doomed"])
        except openai.AuthenticationError as exc:
            return "revoked" in exc.message
        return False

    assert wait_until(refused, timeout_s=5, interval_s=0.2)
    complete(stack, keys["alice"])  # the others still work


def test_requests_per_minute_give_429_with_retry_after(stack, keys):
    complete(stack, keys["rpm"])
    complete(stack, keys["rpm"])
    response = httpx.post(
        stack.base_url + "/completions",
        json={"model": MODEL, "prompt": "hello", "max_tokens": 1},
        headers={"authorization": f"Bearer {keys['rpm']}"},
    )
    error = assert_openai_error(response, 429, "rate_limit_exceeded")
    assert "2 requests per minute" in error["message"]
    assert 20 <= int(response.headers["retry-after"]) <= 30
    complete(stack, keys["alice"])  # another key's budget is its own


def test_tokens_per_minute_count_prompt_plus_max_tokens(stack, keys):
    complete(stack, keys["tpm"], max_tokens=60)
    with pytest.raises(openai.RateLimitError) as refused:
        complete(stack, keys["tpm"], max_tokens=60)  # about 35 of 100 left
    assert "100 tokens per minute" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) >= 1


def test_concurrent_streams_are_bounded(stack, keys):
    stream = complete(stack, keys["streams"], max_tokens=400, stream=True)  # about 2 s of decode
    next(iter(stream))
    with pytest.raises(openai.RateLimitError, match="in flight"):
        complete(stack, keys["streams"])
    stream.close()  # the client leaves: its slot comes back

    def served() -> bool:
        try:
            return complete(stack, keys["streams"]).usage.completion_tokens == 2
        except openai.RateLimitError:
            return False

    assert wait_until(served, timeout_s=5, interval_s=0.1)


def test_several_prompts_take_a_stream_each_and_a_refusal_cancels_the_ones_submitted(stack, keys):
    """A completions request of two prompts is two requests (ingress.prompts): past the key's
    one stream it is a 429 whole, and the prompt already submitted is cancelled, its route
    closed and its stream given back."""

    def cancelled() -> float:
        sample = stack.ingress.metrics.registry.get_sample_value("switchyard_requests_total", {"outcome": "cancelled"})
        return sample or 0.0

    cancels_before = cancelled()
    with pytest.raises(openai.RateLimitError, match="in flight"):
        complete(stack, keys["streams"], prompt=["one prompt", "and another"])
    assert len(stack.ingress.router) == 0
    assert cancelled() == cancels_before + 1
    assert complete(stack, keys["streams"]).usage.completion_tokens == 2


def cached(stack, secret: str, tenant: str | None = None) -> int:
    headers = {"x-switchyard-tenant": tenant} if tenant else None
    reply = complete(stack, secret, prompt=PROMPT, max_tokens=1, extra_headers=headers)
    return reply.usage.prompt_tokens_details.cached_tokens


def test_a_spoofed_tenant_header_cannot_read_another_tenants_cache(stack, keys):
    assert cached(stack, keys["alice"]) == 0
    warm = cached(stack, keys["alice"])
    assert warm > 0
    with pytest.raises(openai.PermissionDeniedError):
        cached(stack, keys["mallory"], tenant="acme")  # the victim's tenant, asserted
    assert cached(stack, keys["mallory"]) == 0  # its own tenant: the victim's prompt is not cached for it
    assert cached(stack, keys["proxy"], tenant="acme") == warm  # a trusted proxy speaks for acme


def test_a_trusted_proxy_scopes_the_cache_by_the_tenant_it_asserts(stack, keys):
    block = stack.ingress.config.block_size
    prompt_tenants = ("initech", "globex")
    assert cached(stack, keys["proxy"], prompt_tenants[0]) == 0
    warm = cached(stack, keys["proxy"], prompt_tenants[0])
    assert warm > 0 and warm % block == 0
    assert cached(stack, keys["proxy"], prompt_tenants[1]) == 0  # the same text, another tenant: no hit
    assert cached(stack, keys["proxy"], prompt_tenants[1]) == warm
    response = httpx.post(
        stack.base_url + "/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        headers={"authorization": f"Bearer {keys['proxy']}", "x-switchyard-tenant": "no spaces allowed"},
    )
    assert response.status_code == 400
