"""Mid-stream migration: a decode worker SIGKILLed while it streams, the stream continues on
another decode worker, and the client's greedy text is the undisturbed run's."""

from __future__ import annotations

import re
import signal
import subprocess

import httpx
import openai

from switchyard import procs
from switchyard.scheduler.config import SchedulerConfig
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
