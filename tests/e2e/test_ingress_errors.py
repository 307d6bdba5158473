"""Through the real HTTP API: how a request's ending is recorded, out-of-range numbers,
and the catch-all for exceptions nobody expected (always an OpenAI-shaped JSON error,
the request's stream entry closed, its span ended with an error status)."""

from __future__ import annotations

import httpx
import msgspec
import openai
import pytest
from opentelemetry.trace import StatusCode

from switchyard.ingress.app import Ingress
from switchyard.ingress.text import TextAssembler
from tests.support.stack import MODEL, running_stack, wait_until

MESSAGES = [{"role": "user", "content": "Tell me about the switchyard."}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def stack(module_nats):
    with running_stack(module_nats.url) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def post(stack, **fields) -> httpx.Response:
    return httpx.post(stack.ingress.url + CHAT, json={"model": MODEL, "messages": MESSAGES, **fields}, timeout=30)


def outcomes(stack) -> dict[str, float]:
    counter = stack.ingress.metrics.requests
    return {labels[0]: child._value.get() for labels, child in counter._metrics.items()}


def finished_span(spans):
    """This test's request span (an earlier test's may end late, after the exporter was cleared)."""

    def ours():
        return [s for s in spans.get_finished_spans() if s.name == f"POST {CHAT}" and s.start_time >= spans.cleared_at]

    assert wait_until(lambda: any(ours()))
    (span,) = ours()
    return span


def assert_openai_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error


# --- outcomes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_a_completed_request_counts_as_ok_not_cancelled(client, stack, spans, stream):
    before = outcomes(stack)
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=stream)
    if stream:
        assert [c.choices[0].finish_reason for c in reply if c.choices and c.choices[0].finish_reason] == ["length"]
    assert wait_until(lambda: sum(outcomes(stack).values()) == sum(before.values()) + 1)
    after = outcomes(stack)
    assert after.get("ok", 0) == before.get("ok", 0) + 1
    assert after.get("cancelled", 0) == before.get("cancelled", 0)
    assert finished_span(spans).attributes["switchyard.outcome"] == "ok"


# --- numbers out of range -----------------------------------------------------------------------


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**40])
def test_a_seed_the_bus_cannot_carry_is_400_naming_it(stack, seed):
    error = assert_openai_error(post(stack, seed=seed, max_tokens=2), 400, "seed")
    assert error["type"] == "invalid_request_error"
    assert len(stack.ingress.router) == 0  # no stream entry left for the idle watchdog


@pytest.mark.parametrize("seed", [2**64 - 1, -(2**63), 0])
def test_seeds_at_the_edges_are_served(stack, seed):
    assert post(stack, seed=seed, max_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_completion_tokens": 10**30}, "max_completion_tokens"),
        ({"max_tokens": -(10**30)}, "max_tokens"),
        ({"n": 10**30}, "n"),
        ({"temperature": 1e300}, "temperature"),
        ({"top_p": -1e300}, "top_p"),
    ],
)
def test_other_numbers_out_of_range_are_400_naming_them(stack, fields, param):
    assert_openai_error(post(stack, **fields), 400, param)
    assert len(stack.ingress.router) == 0


def test_a_float_past_double_range_is_400_naming_it(stack):
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], "temperature": 1e400}' % MODEL.encode()
    response = httpx.post(stack.ingress.url + CHAT, content=raw, headers={"content-type": "application/json"})
    assert_openai_error(response, 400, "temperature")


def test_a_completion_prompt_token_out_of_range_is_400(stack):
    body = {"model": MODEL, "prompt": [1, 10**30], "max_tokens": 2}
    response = httpx.post(stack.ingress.url + "/v1/completions", json=body, timeout=30)
    assert_openai_error(response, 400, "prompt")


# --- content parts ----------------------------------------------------------------------------------


def test_a_text_part_without_text_is_400_naming_the_missing_field(stack):
    messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text"}]}]
    response = httpx.post(stack.ingress.url + CHAT, json={"model": MODEL, "messages": messages}, timeout=30)
    error = assert_openai_error(response, 400, "messages[0].content[1].text")
    assert "`text`" in error["message"] and "not supported" not in error["message"]


# --- fields the ingress cannot honour (ingress.fields) ----------------------------------------------


TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]


def test_a_field_that_would_change_the_output_is_refused_through_the_openai_client(client, stack):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"prompt_logprobs": 1})
    assert caught.value.param == "prompt_logprobs" and caught.value.code == "unsupported_parameter"
    assert "prompt logprobs" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, extra_body={"bad_words": ["x"]})
    assert caught.value.param == "bad_words"
    # This ingress has no tool-call parser: a tool_choice of auto would return calls as text.
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, tools=TOOLS)
    assert caught.value.param == "tool_choice" and "--tool-call-parser" in caught.value.message
    assert len(stack.ingress.router) == 0


def test_fields_without_effect_and_neutral_values_are_served(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=2, user="x", tools=[], logprobs=False, extra_body={"top_k": -1}
    )
    assert reply.choices[0].finish_reason == "length"


# --- the catch-all ---------------------------------------------------------------------------------------


def _boom(*args, **kwargs):
    raise RuntimeError("an internal fault")


def assert_internal_error(response: httpx.Response) -> None:
    error = assert_openai_error(response, 500)
    assert error["type"] == "server_error"
    assert "internal fault" not in error["message"]  # the client learns nothing of our insides


def test_an_unexpected_error_before_admission_is_a_json_500(stack, spans, monkeypatch):
    monkeypatch.setattr(Ingress, "_submit", _boom)
    before = outcomes(stack)
    assert_internal_error(post(stack, max_tokens=4))
    assert len(stack.ingress.router) == 0
    span = finished_span(spans)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["switchyard.outcome"] == "error"
    assert outcomes(stack).get("error", 0) == before.get("error", 0) + 1


def test_an_unexpected_error_before_any_span_is_a_json_500(stack, monkeypatch):
    monkeypatch.setattr(type(stack.ingress.tokenizer), "render_chat", _boom)
    assert_internal_error(post(stack, max_tokens=4))
    assert len(stack.ingress.router) == 0


def test_an_unexpected_error_while_generating_is_a_json_500(stack, spans, monkeypatch):
    monkeypatch.setattr(TextAssembler, "push", _boom)
    assert_internal_error(post(stack, max_tokens=4))
    assert wait_until(lambda: len(stack.ingress.router) == 0)
    span = finished_span(spans)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["switchyard.outcome"] == "error"


def test_an_unexpected_error_while_streaming_ends_the_stream_with_an_error_event(stack, spans, monkeypatch):
    push, finish, sent = TextAssembler.push, TextAssembler.finish, []

    # Boom once some text has gone out (the response starts with the first delta): at the next
    # push, or at the end if every token came in that one delta (coalesced under load).
    def push_after_text(self, token_ids):
        if sent:
            _boom()
        text = push(self, token_ids)
        if text:
            sent.append(text)
        return text

    def finish_after_text(self):
        return _boom() if sent else finish(self)

    monkeypatch.setattr(TextAssembler, "push", push_after_text)
    monkeypatch.setattr(TextAssembler, "finish", finish_after_text)
    with httpx.stream(
        "POST", stack.ingress.url + CHAT, json={"model": MODEL, "messages": MESSAGES, "stream": True}, timeout=30
    ) as response:
        assert response.status_code == 200  # the stream had begun: the error comes as an event
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    error = msgspec.json.decode(events[-1])["error"]
    assert error["type"] == "server_error" and set(error) == {"message", "type", "param", "code"}
    assert "[DONE]" not in events
    assert wait_until(lambda: len(stack.ingress.router) == 0)
    assert finished_span(spans).status.status_code == StatusCode.ERROR
