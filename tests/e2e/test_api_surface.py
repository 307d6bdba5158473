"""The rest of the surface clients reach for, through the real HTTP API: the model by its id,
/tokenize and /detokenize as vLLM shapes them, x-request-id echoed, CORS off unless asked."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.stack import MODEL, running_stack

MESSAGES = [{"role": "user", "content": "How many wagons are on track nine?"}]


@pytest.fixture(scope="module")
def stack(module_nats):
    with running_stack(module_nats.url, ingress_overrides={"cors_allow_origins": "https://console.example"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def test_the_model_is_found_by_its_id(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert "no-such-model" in missing.value.message


def test_tokenize_gives_the_ids_a_request_prefills(client, stack):
    url = stack.ingress.url
    chat = httpx.post(f"{url}/tokenize", json={"model": MODEL, "messages": MESSAGES}).json()
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert chat["count"] == len(chat["tokens"]) == reply.usage.prompt_tokens
    assert chat["max_model_len"] == stack.ingress.tokenizer.info.max_context
    text = "Track nine holds forty wagons."
    plain = httpx.post(f"{url}/tokenize", json={"prompt": text}).json()
    completion = client.completions.create(model=MODEL, prompt=text, max_tokens=2)
    assert plain["count"] == completion.usage.prompt_tokens
    back = httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": plain["tokens"]}).json()
    assert back == {"prompt": text}


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": MESSAGES}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_tokenize_refuses_what_it_cannot_answer(stack, path, body, param):
    reply = httpx.post(stack.ingress.url + path, json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_x_request_id_is_echoed_or_made(stack, client):
    mine = httpx.post(
        stack.base_url + "/completions",
        json={"model": MODEL, "prompt": "hi", "max_tokens": 1},
        headers={"x-request-id": "req-7f3a"},
    )
    assert mine.status_code == 200 and mine.headers["x-request-id"] == "req-7f3a"
    made = httpx.get(stack.base_url + "/models").headers["x-request-id"]
    assert len(made) == 32 and made != httpx.get(stack.base_url + "/models").headers["x-request-id"]
    unsafe = httpx.get(stack.base_url + "/models", headers={"x-request-id": "a b"}).headers["x-request-id"]
    assert unsafe != "a b" and len(unsafe) == 32
    refused = httpx.post(stack.base_url + "/completions", json={"model": "other"}, headers={"x-request-id": "r-1"})
    assert refused.status_code in (400, 404) and refused.headers["x-request-id"] == "r-1"
    raw = client.with_raw_response.models.list()
    assert raw.headers["x-request-id"]


def test_cors_answers_only_the_origins_configured(stack):
    preflight = {"access-control-request-method": "POST", "access-control-request-headers": "content-type"}
    allowed = httpx.options(
        stack.base_url + "/chat/completions", headers={"origin": "https://console.example", **preflight}
    )
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "https://console.example"
    other = httpx.options(stack.base_url + "/chat/completions", headers={"origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_cors_is_off_by_default(module_nats):
    with running_stack(module_nats.url) as plain:
        reply = httpx.options(
            plain.base_url + "/chat/completions",
            headers={"origin": "https://console.example", "access-control-request-method": "POST"},
        )
        assert "access-control-allow-origin" not in reply.headers


def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # vLLM's extension
    )
    chunks = list(stream)
    content = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert content and all(c.usage is not None for c in content)
    counts = [c.usage.completion_tokens for c in content]
    assert counts == sorted(counts) and 0 < counts[0] and counts[-1] <= 12
    assert {c.usage.prompt_tokens for c in content} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices
    plain = list(
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, stream=True, stream_options={"include_usage": True}
        )
    )
    assert all(c.usage is None for c in plain[:-1])  # without it: usage only at the end
