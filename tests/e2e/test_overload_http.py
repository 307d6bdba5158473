"""Through the real HTTP API, with the official ``openai`` client: what a client sees when the
SLO-aware scheduler (``ttft_slo_s`` with the ``switchyard`` policy) gives a request up.

Two ways, two answers:

- *Shed late* (``SchedulerCore._shed_late``): the request was admitted, found no slack within
  two SLOs and its stream fails with ``overloaded``. That is a 429 ``rate_limit_error``
  (``ingress.errors.Shed``) saying why, streaming or not: a stream's response starts with its
  first token (``ingress.generation``), so a shed before it is answered as a plain request is,
  and the client sees ``RateLimitError`` at ``create()`` (its own retry on 429 applies). Its
  Retry-After is the scheduler's predicted wait, as for an admission refusal.
- *Refused up front* (the core's decode-side refusal): a prefilled request waits for decode
  room, so a new one is answered 429 with a Retry-After before anything else, streaming or not.

Each stack then serves a request under light load, so the 429s come from the load, not from a
configuration that refuses everything. Timing is made deterministic by the scheduler's own
predictions, not by races: a prefill rate the scheduler assumes and the sim worker really has,
a blocker whose prefill lasts much longer than the shed's wait, and waits on the scheduler's
state (a request's phase) before each overloaded request is sent.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from switchyard.scheduler.config import SchedulerConfig
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, running_stack, wait_until, worker_config

SLO_S = 0.2  # a late request is shed after 2 SLOs (``_LATE_WAIT_SLOS``): 0.4 s
RATE = 1000.0  # prefill tokens/s: assumed by the scheduler, and the sim worker's real speed
BLOCKER_TOKENS = 2500  # 2.5 s of prefill: a request behind it is late on arrival, and shed first
# 300 tokens take 18 s: the first long request must still hold the decode worker once the
# second is prefilled, however slow a loaded machine makes that (6 s was not always enough:
# the second went on to decode and finished, unseen, within the 10 s of waiting for it).
SLOW_DECODE = SimCostModel(decode_step_base_s=0.06)
DECODE_BUDGET = 400  # KV tokens: one request of a short prompt + 300 tokens at a time
MESSAGES = [{"role": "user", "content": "Count the wagons in the yard."}]


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def _queued_or_placed(stack) -> int:
    return len(stack.scheduler.core.requests)


def _prefill_load(stack) -> int:
    return sum(w.inflight_tokens for w in stack.scheduler.core.status().workers if w.role == "prefill")


def _served_normally(client: openai.OpenAI) -> None:
    """A short request on an idle stack: it meets the SLO's prediction and is served."""
    reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True))
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["length"]


# --- shed late: admitted, then given up ------------------------------------------------------------


@pytest.fixture
def late_stack(nats):
    scheduler = SchedulerConfig(
        worker_expiry_s=1.0, policy="switchyard", ttft_slo_s=SLO_S, default_prefill_tokens_per_s=RATE
    )
    with running_stack(nats.url, scheduler=scheduler, prefill_cost=SimCostModel(prefill_per_token_s=1 / RATE)) as stack:
        yield stack


def _shed_non_streaming(client: openai.OpenAI) -> openai.RateLimitError:
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4)
    return info.value


def _shed_streaming(client: openai.OpenAI) -> openai.RateLimitError:
    """Refused at ``create()``: no stream is returned, so no chunk is ever read."""
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, stream=True)
    return info.value


def _assert_shed_message(message: str) -> None:
    assert "was shed: overloaded" in message, message
    assert f"could not meet the {SLO_S:g} s time to first token" in message, message


def test_a_late_request_is_shed_with_429_and_a_light_one_is_served(late_stack):
    client = _client(late_stack)
    _served_normally(client)  # the same stack, before any load
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        # One long prompt (distinct tokens: no prefix of it is cached) occupies the only prefill
        # worker for 2.5 s. It is late itself, but it found the worker idle: it runs on slack.
        blocker = pool.submit(
            client.completions.create, model=MODEL, prompt=list(range(300, 300 + BLOCKER_TOKENS)), max_tokens=1
        )
        assert wait_until(lambda: _prefill_load(late_stack) >= BLOCKER_TOKENS, timeout_s=10)
        # Behind 2.5 s of prefill, a request cannot meet 0.2 s: it is late on arrival, waits
        # for slack that does not come within 1 s, and is shed while the blocker still runs.
        plain = pool.submit(_shed_non_streaming, client)
        streamed = pool.submit(_shed_streaming, client)
        shed = plain.result(timeout=20)
        streamed_shed = streamed.result(timeout=20)
        assert blocker.result(timeout=20).usage.completion_tokens == 1

    # Streaming or not, the same answer: the stream was shed before its first token, so its
    # response had not started (a JSON 429, not an SSE stream with an error event).
    for refused in (shed, streamed_shed):
        assert refused.status_code == 429
        assert refused.response.headers["content-type"] == "application/json"
        assert refused.body["type"] == "rate_limit_error" and refused.code == "overloaded"
        _assert_shed_message(refused.message)
        # The scheduler names a wait, as an admission refusal does: once the prefill fleet has
        # worked off what it has now (the blocker's rest: at least 1 s).
        assert int(refused.response.headers["retry-after"]) >= 1

    # Load-dependent: with the blocker gone, the same request is served.
    assert wait_until(lambda: _queued_or_placed(late_stack) == 0)
    _served_normally(client)


# --- refused up front: decode is full ----------------------------------------------------------------


@pytest.fixture
def decode_stack(nats):
    scheduler = SchedulerConfig(worker_expiry_s=1.0, policy="switchyard", ttft_slo_s=SLO_S)
    with running_stack(nats.url, decode=0, scheduler=scheduler) as stack:
        stack.add_worker(worker_config(nats.url, "decode", SLOW_DECODE, token_budget=DECODE_BUDGET))
        stack.wait_healthy(prefill=1, decode=1)
        yield stack


def _phase(stack, request_id: str) -> str | None:
    tracked = stack.scheduler.core.requests.get(request_id)
    return tracked.phase if tracked is not None else None


def _opened(client: openai.OpenAI, stack, phase: str):
    """A long streaming request, once the scheduler has it in ``phase``. Greedy: the response
    starts with the first token that has text (``ingress.generation``), and a sampled token 0
    may have none (a piece of a character). Then its role chunk waited for token 1, that is for
    the decode room this test keeps full: 18 s, after which the request read ``decode``, not
    ``awaiting_decode`` (about 1 run in 20). Greedy, token 0 is the same each run, with text."""
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=300, stream=True, temperature=0)
    first = next(iter(stream))  # the role chunk, sent with token 0's text; its id is the request's
    assert wait_until(lambda: _phase(stack, first.id) == phase, timeout_s=10), _phase(stack, first.id)
    return stream


def test_a_full_decode_fleet_refuses_up_front_with_retry_after(decode_stack):
    client = _client(decode_stack)
    _served_normally(client)
    decoding = _opened(client, decode_stack, "decode")  # holds the decode worker for 18 s
    waiting = _opened(client, decode_stack, "awaiting_decode")  # prefilled, no room for it
    # A small request (the overcommit limit has room for it): refused because one already waits.
    with pytest.raises(openai.RateLimitError) as plain:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
    # Streaming or not, the refusal comes before the response starts: a 429, not an SSE stream.
    with pytest.raises(openai.RateLimitError) as streamed:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, stream=True)
    decoding.close()  # the clients go away: both are cancelled, and decode room frees
    waiting.close()

    for refused in (plain.value, streamed.value):
        assert refused.status_code == 429
        assert refused.body["type"] == "rate_limit_error" and refused.code == "overloaded"
        assert "decode is full: 1 prefilled requests wait for room" in refused.message, refused.message
        retry_after = refused.response.headers["retry-after"]
        assert int(retry_after) >= 1 and f"retry in about {retry_after} s" in refused.message

    assert wait_until(lambda: _queued_or_placed(decode_stack) == 0, timeout_s=10)
    _served_normally(client)
