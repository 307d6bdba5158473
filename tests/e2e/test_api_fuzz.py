"""Whatever a client sends, the API answers with a status it documents and an OpenAI
error body, never a 500 and never a hang. Seeded (hypothesis prints a failing example)."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.stack import MODEL, running_stack

ALLOWED = {200, 400, 404, 413, 429, 503}

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "tool", "bogus", 7]),
        "content": st.one_of(st.text(max_size=60), json_values),
    }
)
chat_bodies = st.fixed_dictionaries(
    {"model": st.sampled_from([MODEL, MODEL, "other", 3])},
    optional={
        "messages": st.one_of(st.lists(message, max_size=3), json_values),
        "max_tokens": st.one_of(st.integers(-5, 5000), json_values),
        "max_completion_tokens": st.integers(-5, 50),
        "stream": st.booleans(),
        "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.booleans()}), json_values),
        "stop": st.one_of(st.text(max_size=5), st.lists(st.text(max_size=5), max_size=6), json_values),
        "n": st.integers(-1, 3),
        "temperature": st.one_of(st.floats(-1, 3), json_values),
        "top_p": st.floats(-1, 2),
        "seed": st.integers(-5, 5),
        "extra": json_values,
    },
)


@pytest.fixture(scope="module")
def stack(module_nats):
    with running_stack(module_nats.url) as stack:
        yield stack


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=chat_bodies)
def test_any_chat_body_gets_a_documented_answer(stack, body):
    response = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=20)
    assert response.status_code in ALLOWED, (response.status_code, response.text)
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and error["type"]


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=st.binary(max_size=200))
def test_any_bytes_get_a_documented_answer(stack, raw):
    response = httpx.post(
        stack.base_url + "/completions", content=raw, timeout=20, headers={"content-type": "application/json"}
    )
    assert response.status_code in ALLOWED - {200}, (response.status_code, response.text)
    assert response.json()["error"]["type"] == "invalid_request_error"
