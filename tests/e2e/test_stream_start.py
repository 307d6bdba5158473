"""Through the real HTTP API: when a streaming response starts (``ingress.generation``).

A stream's response starts with its first delta, so what happens before it is either invisible
(a migration) or answered as a plain request is (a JSON error with its status); an output with
no text at all still gets a whole stream, started at its end.
"""

from __future__ import annotations

import concurrent.futures
import re
import signal
import subprocess

import httpx
import msgspec
import openai
import pytest

from switchyard import procs
from switchyard.ingress.text import TextAssembler
from switchyard.scheduler.config import SchedulerConfig
from switchyard.workers.sim import SimCostModel
from tests.support.stack import MODEL, SIM, running_stack, wait_until, worker_config

MESSAGES = [{"role": "user", "content": "Count the wagons in the yard."}]
CHAT = "/v1/chat/completions"


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)


def _metric(stack, name: str) -> float:
    text = httpx.get(stack.ingress.url + "/metrics").text
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def _events(response: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]


# --- an output with no text ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eos_stack(module_nats):
    """Every output's token 0 is EOS: a completion of no text, finished with ``stop``."""
    with running_stack(module_nats.url, worker_overrides={"sim": msgspec.structs.replace(SIM, eos_per_token=1.0)}) as s:
        yield s


def test_a_stream_with_no_text_is_still_a_whole_stream(eos_stack):
    stream = _client(eos_stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=8, n=2, stream=True, stream_options={"include_usage": True}
    )
    assert stream.response.status_code == 200
    chunks = list(stream)
    roles = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:2]]
    assert roles == [(0, "assistant"), (1, "assistant")]  # each choice's role chunk first
    finished = {
        c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    }
    assert finished == {0: "stop", 1: "stop"}
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None  # the usage chunk, last
    assert chunks[-1].usage.completion_tokens == 2  # each choice's EOS


@pytest.mark.parametrize("path", [CHAT, "/v1/completions"])
def test_a_stream_with_no_text_ends_with_done(eos_stack, path):
    body = {"model": MODEL, "max_tokens": 8, "stream": True}
    body |= {"messages": MESSAGES} if path == CHAT else {"prompt": "Count the wagons"}
    with httpx.stream("POST", eos_stack.ingress.url + path, json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _events(response)
    assert events[-1] == "[DONE]"
    chunks = [msgspec.json.decode(event) for event in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    if path == CHAT:
        assert [c["choices"][0]["delta"] for c in chunks] == [{"role": "assistant", "content": ""}, {}]
    else:
        assert [c["choices"][0]["text"] for c in chunks] == [""]


def test_an_unexpected_error_before_the_first_delta_is_a_json_500(eos_stack, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("an internal fault")

    monkeypatch.setattr(TextAssembler, "push", boom)
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True}
    response = httpx.post(eos_stack.ingress.url + CHAT, json=body, timeout=30)
    assert response.status_code == 500  # nothing had been sent: no stream, a plain error
    assert response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "server_error"
    assert wait_until(lambda: len(eos_stack.ingress.router) == 0)


# --- a lost worker before the first token ------------------------------------------------------------


def _prefill_process(nats_url: str, *flags: str) -> subprocess.Popen:
    """A prefill worker in its own process, so that a test can SIGKILL it."""
    command = procs.service_command(
        "worker", "--role", "prefill", "--nats", nats_url, "--report-interval-s", "0.1", "--log-level", "warning"
    )
    return procs.spawn([*command, *flags], env=procs.child_env())


def _prefilling(stack) -> bool:
    return any(w.role == "prefill" and w.inflight_tokens for w in stack.scheduler.core.status().workers)


def _killed_in_prefill(stack, request, replacement: bool):
    """``request()`` in a thread, its prefill worker (a process that takes 30 s) SIGKILLed
    once it has the request, a fresh prefill worker started first if ``replacement``."""
    child = _prefill_process(stack.nats_url, "--sim-prefill-base-s", "30")
    try:
        stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(request)
            assert wait_until(lambda: _prefilling(stack), timeout_s=5)
            if replacement:
                stack.add_worker(worker_config(stack.nats_url, "prefill", SimCostModel(prefill_base_s=0.5)))
            child.send_signal(signal.SIGKILL)
            return pending.result(timeout=30)
    finally:
        procs.stop([child])


def test_a_stream_whose_prefill_worker_dies_before_its_first_token_is_served(nats):
    with running_stack(nats.url, prefill=0, scheduler=SchedulerConfig(worker_expiry_s=0.5)) as stack:

        def stream() -> list:
            created = _client(stack).chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=3, stream=True, stream_options={"include_usage": True}
            )
            return list(created)

        chunks = _killed_in_prefill(stack, stream, replacement=True)
        # The migration happened before the response started: the client saw one whole stream.
        assert chunks[0].choices[0].delta.role == "assistant"
        assert any(c.choices[0].delta.content for c in chunks[1:] if c.choices)
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        assert _metric(stack, 'switchyard_migrations_total{outcome="resumed"}') == 1


def test_a_stream_that_cannot_continue_before_its_first_token_is_a_json_error(nats):
    """No prefill worker comes back: the migration is refused, and the stream, not started,
    is answered with the error's own status (502: the worker was lost) as JSON."""
    with running_stack(
        nats.url,
        prefill=0,
        scheduler=SchedulerConfig(worker_expiry_s=0.5),
        ingress_overrides={"migration_wait_s": 1.0},
    ) as stack:

        def stream() -> openai.APIStatusError:
            with pytest.raises(openai.APIStatusError) as info:
                _client(stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3, stream=True)
            return info.value

        error = _killed_in_prefill(stack, stream, replacement=False)
        assert error.status_code == 502 and error.code == "worker_lost"
        assert "could not continue elsewhere" in error.message, error.message
