"""Whatever a client sends, the API answers with a status it documents and an OpenAI
error body, never a 500 and never a hang. Seeded (hypothesis prints a failing example).

Two fuzzers: hand-written strategies for chat bodies and raw bytes, and schemathesis
driven by the API's own ``/openapi.json`` (every endpoint, bodies, headers, valid and not),
checking that no answer is a 5xx or undocumented, none hangs (a 20 s timeout per call),
and the server serves normally afterwards."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from tests.support.stack import MODEL, running_stack

ALLOWED = {200, 400, 404, 413, 429, 503}
ENDPOINTS = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/v1/models/{model}",
    "/tokenize",
    "/detokenize",
    "/health",
    "/metrics",
    "/openapi.json",
    "/v1/files",
    "/v1/files/{file_id}",
    "/v1/files/{file_id}/content",
    "/v1/batches",
    "/v1/batches/{batch_id}",
    "/v1/batches/{batch_id}/cancel",
}

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


# --- the OpenAPI document, and schemathesis against it ---------------------------------------------


def test_the_openapi_document_describes_every_endpoint(stack):
    document = httpx.get(stack.ingress.url + "/openapi.json", timeout=10).json()
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == ENDPOINTS
    chat = document["paths"]["/v1/chat/completions"]["post"]
    ref = chat["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    schema = document["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert {"model", "messages"} <= set(schema["required"])
    assert schema["properties"]["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 2.0}
    assert schema["properties"]["model"]["enum"] == [MODEL]
    assert {"400", "413", "429"} <= set(chat["responses"])


@pytest.fixture(scope="module")
def strategies(stack) -> list:
    """For every operation in the live document, a strategy of valid and one of invalid
    requests. (schemathesis's own pytest loader from a fixture does not run on pytest 9.)"""
    schema = schemathesis.openapi.from_url(stack.ingress.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    return [op.as_strategy(generation_mode=mode) for op in operations for mode in GenerationMode]


@settings(max_examples=150, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_generated_request_gets_a_documented_answer(stack, strategies, data):
    case = data.draw(st.sampled_from(strategies).flatmap(lambda strategy: strategy))
    response = case.call(base_url=stack.ingress.url, timeout=20)  # a hang fails the test
    case.validate_response(response, checks=[not_a_server_error, status_code_conformance, content_type_conformance])


def test_the_server_serves_normally_after_the_fuzzing(stack):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 4}
    response = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=20)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 4
