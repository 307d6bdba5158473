"""End to end through the official ``openai`` client: HTTP -> NATS -> scheduler ->
prefill -> decode -> NATS -> SSE, all real, on one shared stack for this module."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.stack import MODEL, running_stack, wait_until

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Tell me about the switchyard."},
]


@pytest.fixture(scope="module")
def stack(module_nats):
    with running_stack(module_nats.url) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def raw(stack, path: str, **kwargs) -> httpx.Response:
    return httpx.post(stack.base_url + path, timeout=30, **kwargs)


# --- the happy paths ---------------------------------------------------------------------------


def test_chat_non_streaming_reports_usage_and_length(client, stack):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.model == MODEL
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    prompt = stack.ingress.tokenizer.encode_chat(MESSAGES)
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == 24
    assert reply.usage.total_tokens == len(prompt) + 24
    assert reply.usage.prompt_tokens_details.cached_tokens is not None


def test_chat_streaming_matches_non_streaming_and_ends_once(client):
    # Greedy sim output is a pure function of the prompt: both paths must agree exactly.
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=40,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finishes == ["length"]
    assert chunks[0].choices[0].delta.role == "assistant"
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and usage_chunks[0] is chunks[-1] and chunks[-1].choices == []
    assert usage_chunks[0].usage.completion_tokens == 40
    assert usage_chunks[0].usage.prompt_tokens_details.cached_tokens >= 0


def test_stream_without_include_usage_has_no_usage(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, stream=True))
    assert all(c.usage is None for c in chunks)
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 1


def test_completions_streaming_and_not(client, stack):
    whole = client.completions.create(model=MODEL, prompt="The yard at dawn", max_tokens=16, temperature=0)
    assert whole.object == "text_completion" and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(stack.ingress.tokenizer.encode("The yard at dawn"))
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The yard at dawn",
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_completions_accepts_token_ids(client):
    reply = client.completions.create(model=MODEL, prompt=[300, 301, 302, 303], max_tokens=3)
    assert reply.usage.prompt_tokens == 4 and reply.usage.completion_tokens == 3


PROMPTS = ["The yard at dawn", "Signals change", "A freight train waits on the siding"]


def test_completions_of_several_prompts_number_choices_per_prompt_and_sum_usage(client, stack):
    # Each prompt alone first: greedy sim output is a pure function of the prompt.
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    reply = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in reply.choices] == list(range(6))
    for c in reply.choices:  # prompt i's choice j is choice i * n + j, as OpenAI and vLLM number them
        assert c.text == alone[c.index // 2].choices[0].text and c.finish_reason == "length"
    assert reply.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert reply.usage.completion_tokens == 6 * 6
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + 36
    tokens = [stack.ingress.tokenizer.encode(p) for p in PROMPTS]  # token-id lists alike
    by_ids = client.completions.create(model=MODEL, prompt=tokens, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [a.choices[0].text for a in alone]


def test_completions_of_several_prompts_stream_as_one_response(client, stack):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len({c.id for c in chunks}) == 1  # one response, whichever prompt a chunk is of
    texts = {i: "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)}
    assert texts == {c.index: c.text for c in whole.choices}
    finishes = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == [0, 1, 2]
    usage = [c for c in chunks if c.usage is not None]
    assert len(usage) == 1 and usage[0] is chunks[-1] and chunks[-1].choices == []
    assert usage[0].usage.prompt_tokens == whole.usage.prompt_tokens and usage[0].usage.completion_tokens == 36
    assert wait_until(lambda: len(stack.ingress.router) == 0)  # every prompt's route closed


def test_completions_of_several_prompts_refused_whole(client, stack):
    with pytest.raises(openai.BadRequestError, match="at most 128"):
        client.completions.create(model=MODEL, prompt=["a"] * 65, max_tokens=1, n=2)
    with pytest.raises(openai.BadRequestError, match="all strings"):
        client.completions.create(model=MODEL, prompt=["a", [300, 301]], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        client.completions.create(model=MODEL, prompt=[[300], []], max_tokens=1)
    # One prompt past the context refuses the request before any runs.
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt=[[300], [300] * 5000], max_tokens=1)
    assert len(stack.ingress.router) == 0


def test_chat_template_kwargs_reach_the_template(client, stack):
    """vLLM's ``chat_template_kwargs`` (Qwen3's ``enable_thinking``, which the bundled template
    reads as Qwen3's does): the prompt the engine gets is the template's with them."""
    plain = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    quiet = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, extra_body=kwargs)
    expected = stack.ingress.tokenizer.encode(
        stack.ingress.tokenizer.render_chat(MESSAGES, kwargs={"enable_thinking": False})
    )
    assert quiet.usage.prompt_tokens == len(expected) > plain.usage.prompt_tokens
    counted = httpx.post(stack.ingress.url + "/tokenize", json={"model": MODEL, "messages": MESSAGES, **kwargs}).json()
    assert counted["tokens"] == expected  # /tokenize renders the same
    # reasoning_effort "none" turns thinking off as vLLM does it (enable_thinking false).
    effortless = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2, reasoning_effort="none")
    assert effortless.usage.prompt_tokens == len(expected)
    with pytest.raises(openai.BadRequestError, match="needs a reasoning parser"):  # this stack has none
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"include_reasoning": False}
        )
    with pytest.raises(openai.BadRequestError, match="may not set 'messages'"):
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=2, extra_body={"chat_template_kwargs": {"messages": []}}
        )


def test_max_completion_tokens_and_content_parts(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=7)
    assert reply.usage.completion_tokens == 7
    same = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=1
    )
    assert same.usage.prompt_tokens == reply.usage.prompt_tokens


def test_max_tokens_one_finishes_at_prefill(client):
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    assert reply.usage.completion_tokens == 1 and reply.choices[0].finish_reason == "length"


def test_stop_sequence_cuts_text_before_it(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0)
    text = full.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3
    for stream in (False, True):
        reply = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=60, temperature=0, stop=[stop, "\x00never"], stream=stream
        )
        if stream:
            chunks = list(reply)
            got = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
        else:
            got, finish = reply.choices[0].message.content, [reply.choices[0].finish_reason]
        assert got == text[: text.index(stop)], stream
        assert finish == ["stop"]


def test_stop_cancels_the_workers(client, stack):
    full = client.completions.create(model=MODEL, prompt="stop early", max_tokens=30, temperature=0)
    stop = full.choices[0].text[5:8]
    client.completions.create(model=MODEL, prompt="stop early", max_tokens=30, temperature=0, stop=stop)
    assert wait_until(lambda: all(w.role.running() == 0 for w in stack.workers))


def test_repeated_prompt_reports_cached_tokens(client, stack):
    long_prompt = "switchyard " * 120
    first = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    second = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=2)
    block = stack.ingress.config.block_size
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens // block * block


def test_models_health_and_metrics(client, stack):
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(stack.ingress.url + "/health").json()
    assert health["status"] == "ok" and health["prefill_workers"] == 1 and health["decode_workers"] == 1
    assert (health["queued_requests"], health["awaiting_decode"], health["paused_requests"]) == (0, 0, 0)
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    metrics = httpx.get(stack.ingress.url + "/metrics").text
    for name in (
        "switchyard_time_to_first_token_seconds_count",
        "switchyard_time_per_output_token_seconds_count",
        "switchyard_queue_time_seconds_count",
        "switchyard_prompt_tokens_total",
        "switchyard_cached_tokens_total",
        "switchyard_generation_tokens_total",
    ):
        line = next(row for row in metrics.splitlines() if row.startswith(name))
        assert float(line.split()[-1]) > 0 or name == "switchyard_cached_tokens_total", line
    for stage in ("prefill", "decode", "paused"):  # what waits at the scheduler: nothing, now
        assert f'switchyard_scheduler_queued_requests{{stage="{stage}"}} 0.0' in metrics


def test_session_header_is_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, extra_headers={"x-session-affinity": "agent-42"}
    )
    assert reply.usage.completion_tokens == 3


def test_one_request_is_one_trace(client, spans):
    client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
    wanted = {
        "POST /v1/chat/completions",
        "scheduler.admit",
        "scheduler.dispatch.prefill",
        "worker.prefill",
        "scheduler.dispatch.decode",
        "worker.decode",
    }
    assert wait_until(lambda: wanted <= {s.name for s in spans.get_finished_spans()})
    finished = [s for s in spans.get_finished_spans() if s.name in wanted]
    root = next(s for s in finished if s.name == "POST /v1/chat/completions")
    same_trace = {s.name for s in finished if s.context.trace_id == root.context.trace_id}
    assert same_trace == wanted
    by_id = {s.context.span_id: s for s in finished}
    decode = next(s for s in finished if s.name == "worker.decode" and s.context.trace_id == root.context.trace_id)
    assert by_id[decode.parent.span_id].name == "scheduler.dispatch.decode"


# --- bad input: a clear OpenAI error, the right status, never a 500 or a hang ------------------


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b"{not json", 400, None),
        (b"", 400, None),
        (b'{"messages": []}', 400, None),  # model missing
        (b'{"model": "switchyard-sim"}', 400, None),  # messages missing
        (b'{"model": 7, "messages": [{"role": "user", "content": "x"}]}', 400, "model"),
        (b'{"model": "switchyard-sim", "messages": "hi"}', 400, "messages"),
        (
            b'{"model": "switchyard-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": "9"}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "switchyard-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            400,
            "max_tokens",
        ),
        (
            b'{"model": "switchyard-sim", "messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}',
            400,
            "max_tokens",
        ),
        (b'{"model": "switchyard-sim", "messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
        (
            b'{"model": "switchyard-sim", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
            400,
            "messages[0].content[0]",
        ),
        (b'{"model": "switchyard-sim", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
    ],
)
def test_bad_chat_input(stack, body, status, param):
    response = raw(stack, "/chat/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    if status == 404:
        assert error["code"] == "model_not_found"


def test_prompt_longer_than_context_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[300] * 5000, max_tokens=1)
    assert info.value.code == "context_length_exceeded"


def test_oversized_body_is_413(stack):
    limit = stack.ingress.config.max_body_bytes
    body = b'{"model": "switchyard-sim", "prompt": "' + b"a" * (limit + 10) + b'"}'
    response = raw(stack, "/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method_are_json_errors(stack):
    missing = httpx.get(stack.ingress.url + "/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()
    wrong = httpx.get(stack.base_url + "/chat/completions")
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_openai_client_raises_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-nope", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=-1)


def test_without_keys_no_client_may_name_a_tenant(client):
    # --auth none (this stack's default): everyone is tenant "default", and naming another
    # tenant would read its cache through cached_tokens. Tenants with keys: tests/e2e/test_auth.py.
    with pytest.raises(openai.PermissionDeniedError, match="trusted-proxy"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, extra_headers={"x-switchyard-tenant": "acme"})
