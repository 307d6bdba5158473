"""What happens when things go wrong: a client leaves, a worker dies, the fleet is full."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import time

import httpx
import openai
import pytest

from switchyard import procs
from switchyard.scheduler.config import SchedulerConfig
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, running_stack, wait_until

SLOW_DECODE = SimCostModel(decode_step_base_s=0.02)  # 50 tokens/s per stream
PROMPT = [{"role": "user", "content": "Count the wagons in the yard."}]


def _worker_process(nats_url: str, role: str, *flags: str) -> subprocess.Popen:
    """A worker in its own process, so that a test can SIGKILL it."""
    return procs.spawn(
        procs.service_command(
            "worker", "--role", role, "--nats", nats_url, "--report-interval-s", "0.1", "--log-level", "warning", *flags
        ),
        env=procs.child_env(),
    )


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def test_disconnect_cancels_on_every_worker(nats):
    with running_stack(nats.url, decode_cost=SLOW_DECODE) as stack:
        decode = stack.workers_of("decode")[0]
        stream = _client(stack).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2000, stream=True)
        received = 0
        for _chunk in stream:
            received += 1
            if received == 5:
                break
        assert decode.role.running() == 1  # still generating while we hold the stream
        stream.close()  # the client goes away mid-stream
        assert wait_until(lambda: all(w.role.running() == 0 for w in stack.workers), timeout_s=5)
        assert wait_until(
            lambda: (
                stack.scheduler.core.status().workers[0].inflight_tokens == 0
                and all(w.inflight_tokens == 0 for w in stack.scheduler.core.status().workers)
            )
        )
        assert wait_until(lambda: len(stack.ingress.router) == 0)


def test_disconnect_while_non_streaming_cancels_too(nats):
    with running_stack(nats.url, decode_cost=SLOW_DECODE) as stack:
        decode = stack.workers_of("decode")[0]
        body = {"model": MODEL, "messages": PROMPT, "max_tokens": 2000}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(stack.base_url + "/chat/completions", json=body, timeout=0.5)
        assert wait_until(lambda: decode.role.running() == 0, timeout_s=5)


def test_decode_worker_killed_mid_stream_gives_an_error_event(nats):
    with running_stack(nats.url, decode=0, scheduler=SchedulerConfig(worker_expiry_s=0.5)) as stack:
        child = _worker_process(nats.url, "decode", "--sim-decode-step-base-s", "0.02")
        try:
            stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
            stream = _client(stack).chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=2000, stream=True)
            received, started = 0, time.monotonic()
            with pytest.raises(openai.APIError) as info:
                for _ in stream:
                    received += 1
                    if received == 5:
                        child.send_signal(signal.SIGKILL)
            assert received >= 5
            assert "worker lost" in str(info.value.message)
            assert time.monotonic() - started < 10  # an error, not a hang
        finally:
            procs.stop([child])
        health = httpx.get(stack.ingress.url + "/health").json()
        assert health["decode_workers"] == 0 and health["status"] == "unavailable"


def test_prefill_worker_lost_before_prefill_is_retried_elsewhere(nats):
    slow_prefill = SimCostModel(prefill_base_s=1.0)
    with running_stack(nats.url, prefill=0, scheduler=SchedulerConfig(worker_expiry_s=0.5)) as stack:
        child = _worker_process(nats.url, "prefill", "--sim-prefill-base-s", "30")
        try:
            stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    _client(stack).chat.completions.create, model=MODEL, messages=PROMPT, max_tokens=3
                )
                assert wait_until(
                    lambda: any(
                        w.role == "prefill" and w.inflight_tokens for w in stack.scheduler.core.status().workers
                    ),
                    timeout_s=5,
                )
                from tests.support.stack import worker_config

                stack.add_worker(worker_config(nats.url, "prefill", slow_prefill))
                child.send_signal(signal.SIGKILL)
                reply = pending.result(timeout=20)
            assert reply.usage.completion_tokens == 3 and reply.choices[0].finish_reason == "length"
        finally:
            procs.stop([child])


def test_overload_gets_429_with_retry_after(nats):
    slow_prefill = SimCostModel(prefill_per_token_s=0.02)  # ~0.2 s per prompt here
    with running_stack(
        nats.url,
        prefill_cost=slow_prefill,
        worker_overrides={"token_budget": 32},
        scheduler=SchedulerConfig(max_queued_tokens=64),
    ) as stack:
        client = _client(stack)

        def call(_):
            try:
                return client.completions.create(
                    model=MODEL, max_tokens=2, prompt="one two three four five six seven eight nine"
                )
            except openai.RateLimitError as exc:
                return exc

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(call, range(16)))
        limited = [o for o in outcomes if isinstance(o, openai.RateLimitError)]
        served = [o for o in outcomes if not isinstance(o, Exception)]
        assert limited and served and len(limited) + len(served) == 16, outcomes
        assert all(o.usage.completion_tokens == 2 for o in served)
        for exc in limited:
            assert int(exc.response.headers["retry-after"]) >= 1
            assert exc.body["type"] == "rate_limit_error" and exc.code == "overloaded"


def test_a_request_queued_past_its_deadline_gets_504(nats):
    slow_prefill = SimCostModel(prefill_base_s=1.5)
    with running_stack(nats.url, prefill_cost=slow_prefill, worker_overrides={"token_budget": 8}) as stack:
        client = _client(stack)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(client.completions.create, model=MODEL, prompt="occupy the only worker", max_tokens=2)
            assert wait_until(lambda: any(w.inflight_tokens for w in stack.scheduler.core.status().workers))
            response = httpx.post(
                stack.base_url + "/completions",
                timeout=30,
                headers={"x-switchyard-deadline-s": "0.5", "x-switchyard-priority": "batch"},
                json={"model": MODEL, "prompt": "too late", "max_tokens": 2},
            )
            assert blocker.result(timeout=30).usage.completion_tokens == 2
        assert response.status_code == 504, response.text
        assert response.json()["error"]["code"] == "deadline_exceeded"


@pytest.mark.parametrize(
    "header, value",
    [("x-switchyard-priority", "urgent"), ("x-switchyard-deadline-s", "soon"), ("x-switchyard-deadline-s", "-1")],
)
def test_bad_scheduling_headers_are_400(nats, header, value):
    with running_stack(nats.url) as stack:
        response = httpx.post(
            stack.base_url + "/completions",
            headers={header: value},
            json={"model": MODEL, "prompt": "x", "max_tokens": 1},
        )
        assert response.status_code == 400 and header in response.json()["error"]["message"]
