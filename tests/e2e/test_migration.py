"""Mid-stream migration: a decode worker SIGKILLed while it streams, the stream continues on
another decode worker, and the client's greedy text is the undisturbed run's; and a stream
takes tokens only from the workers the scheduler assigned to it."""

from __future__ import annotations

import re
import signal
import subprocess

import anyio
import httpx
import nats
import openai

from switchyard import procs
from switchyard.observability import settle
from switchyard.scheduler.config import SchedulerConfig
from switchyard.schemas import StreamBatch, StreamChunk, codec, subjects
from tests.support.stack import MODEL, running_stack, worker_config

PROMPT = [{"role": "user", "content": "Count the wagons in the yard, then the carriages."}]
MAX_TOKENS = 120


def _decode_process(nats_url: str) -> subprocess.Popen:
    """A slow decode worker in its own process (50 tokens/s), so that the test can SIGKILL it."""
    flags = ["--role", "decode", "--nats", nats_url, "--report-interval-s", "0.1", "--log-level", "warning"]
    return procs.spawn(
        procs.service_command("worker", *flags, "--sim-decode-step-base-s", "0.02"), env=procs.child_env()
    )


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_stream_continues_on_another_decode_worker_with_the_same_text(nats):
    with running_stack(nats.url, decode=0, scheduler=SchedulerConfig(worker_expiry_s=0.5)) as stack:
        child = _decode_process(nats.url)
        try:
            stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
            stream = client.chat.completions.create(
                model=MODEL,
                messages=PROMPT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts, usage, finish, deltas = [], None, None, 0
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for choice in chunk.choices:
                    parts.append(choice.delta.content or "")
                    finish = choice.finish_reason or finish
                deltas += 1
                if deltas == 6:  # mid-stream on the child: a second decode worker joins, the child dies
                    stack.add_worker(worker_config(nats.url, "decode"))
                    stack.wait_healthy(prefill=1, decode=2)
                    child.send_signal(signal.SIGKILL)
        finally:
            procs.stop([child])
        assert child.returncode == -signal.SIGKILL  # killed mid-stream, not finished first
        undisturbed = client.chat.completions.create(model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0)
        assert "".join(parts) == undisturbed.choices[0].message.content
        assert usage is not None and usage.completion_tokens == MAX_TOKENS and finish == "length"
        assert usage.prompt_tokens == undisturbed.usage.prompt_tokens
        metrics = httpx.get(stack.ingress.url + "/metrics").text
        assert _metric(metrics, 'switchyard_migrations_total{outcome="resumed"}') == 1
        assert _metric(metrics, "switchyard_recomputed_tokens_total") > 0


def test_a_stream_of_several_prompts_continues_each_on_another_decode_worker(nats):
    """A completions request of two prompts is two requests (ingress.prompts) on the one decode
    worker: killed mid-stream, each continues elsewhere, and the one response is unbroken."""
    prompts = ["Count the wagons in the yard.", "Then count the carriages on track nine."]
    with running_stack(nats.url, decode=0, scheduler=SchedulerConfig(worker_expiry_s=0.5)) as stack:
        child = _decode_process(nats.url)
        try:
            stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
            stream = client.completions.create(
                model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            texts: dict[int, str] = {0: "", 1: ""}
            seen = {0: 0, 1: 0}
            killed = False
            for chunk in stream:
                for choice in chunk.choices:
                    texts[choice.index] += choice.text
                    seen[choice.index] += 1
                if not killed and min(seen.values()) >= 4:  # both mid-stream on the child
                    killed = True
                    stack.add_worker(worker_config(nats.url, "decode"))
                    stack.wait_healthy(prefill=1, decode=2)
                    child.send_signal(signal.SIGKILL)
        finally:
            procs.stop([child])
        assert child.returncode == -signal.SIGKILL
        undisturbed = client.completions.create(model=MODEL, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0)
        assert texts == {c.index: c.text for c in undisturbed.choices}
        metrics = httpx.get(stack.ingress.url + "/metrics").text
        assert _metric(metrics, 'switchyard_migrations_total{outcome="resumed"}') == 2


def test_a_stream_takes_no_tokens_from_a_worker_not_assigned_to_it(nats):
    """Another process forges the rest of a live stream (tokens and a finish) under a worker
    id of its own: the ingress refuses them, counts them, and the client's text is the
    undisturbed run's. (With NATS permissions, `up`'s default, it cannot even publish under
    a real worker's id: tests/bus/test_nats_permissions.py.)"""
    with running_stack(nats.url, decode=0) as stack:
        child = _decode_process(nats.url)
        try:
            stack.wait_healthy(prefill=1, decode=1, timeout_s=20)
            client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=30)
            stream = client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
            )
            parts, forged = [], False
            for chunk in stream:
                parts += [choice.delta.content or "" for choice in chunk.choices]
                if not forged and len(parts) >= 3:
                    anyio.run(_forge, nats.url, stack.ingress.config.ingress_id, chunk.id)
                    forged = True
            undisturbed = client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=MAX_TOKENS, temperature=0
            )
        finally:
            procs.stop([child])
        assert "".join(parts) == undisturbed.choices[0].message.content
        metrics = httpx.get(stack.ingress.url + "/metrics").text
        assert _metric(metrics, "switchyard_stream_refused_chunks") == 4


async def _forge(nats_url: str, ingress_id: str, request_id: str) -> None:
    chunks = [StreamChunk(request_id=request_id, seq=seq, token_ids=[7]) for seq in range(1, 4)]
    chunks.append(StreamChunk(request_id=request_id, seq=4, token_ids=[7], finish_reason="stop"))
    nc = await nats.connect(nats_url)
    try:
        batch = StreamBatch(sender="decode-0", chunks=chunks)  # the body's say counts for nothing
        await nc.publish(subjects.stream(ingress_id, "intruder"), codec.STREAM_BATCH.encode(batch))
        await settle(nc)
    finally:
        await nc.close()
