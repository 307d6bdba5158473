"""A batch survives what a fleet does to it (issue 10): through ``switchyard up`` with two batch
runners and two workers of each role, a batch of 240 lines runs while a batch runner, a prefill
worker and a decode worker are SIGKILLed and nats-server (JetStream on file storage) is killed
too; ``up`` restarts each. Every input line must end with exactly one output or error line,
none duplicated, and ``request_counts`` must add up."""

from __future__ import annotations

import json
import signal
import time

import openai
import psutil
import pytest

from switchyard import procs
from tests.e2e.test_up import READY_S, _start_up, _wait_ready_line

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]
LINES = 240


FLEET = ["--prefill", "2", "--decode", "2", "--batch-runners", "2", "--max-restarts", "10"]
COSTS = ["--sim-decode-step-base-s", "0.01", "--sim-prefill-per-token-s", "0.0002"]


def _child(proc, name: str) -> psutil.Process:
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            command = " ".join(child.cmdline())
        except psutil.NoSuchProcess:
            continue
        if name in command:
            return child
    raise AssertionError(f"no child {name!r}")


def _wait_status(client, batch_id: str, done: set[str], timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            batch = client.batches.retrieve(batch_id)
        except (openai.APIConnectionError, openai.InternalServerError, openai.APIStatusError):
            batch = None  # nats-server restarting: the ingress answers 503 for a moment
        if batch is not None and batch.status in done:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status if batch else '?'}"
        time.sleep(0.3)


def test_every_line_ends_exactly_once_through_kills_of_every_part():
    port = procs.free_port()
    proc = _start_up(port, *FLEET, *COSTS)
    try:
        _wait_ready_line(proc, READY_S)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=3, timeout=30)
        system = "You are the yard master of a busy freight terminal. " * 20  # a shared prefix
        lines = []
        for i in range(LINES):
            body = {
                "model": "switchyard-sim",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"Train {i}?"}],
                "max_tokens": 24,
            }
            lines.append(
                json.dumps({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
            )
        file = client.files.create(file=("in.jsonl", ("\n".join(lines) + "\n").encode()), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        _wait_status(client, batch.id, {"in_progress"}, 60)

        for victim in ("--child batch-runner-0", "--child prefill-0", "--child decode-1"):
            deadline = time.monotonic() + 60
            while client.batches.retrieve(batch.id).request_counts.completed < 20 and time.monotonic() < deadline:
                time.sleep(0.2)  # let work be in flight on every part before each kill
            _child(proc, victim).send_signal(signal.SIGKILL)
            time.sleep(1.5)
        _child(proc, "nats-server").send_signal(signal.SIGKILL)  # JetStream on file storage

        batch = _wait_status(client, batch.id, {"completed", "failed", "expired", "cancelled"}, 300)
        assert batch.status == "completed", batch
        counts = batch.request_counts
        assert counts.total == LINES and counts.completed + counts.failed == LINES
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        errors = []
        if batch.error_file_id:
            errors = [json.loads(x) for x in client.files.content(batch.error_file_id).text.splitlines()]
        ids = [x["custom_id"] for x in out + errors]
        assert len(ids) == len(set(ids)) == LINES, "a line lost or duplicated"
        assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES))
        assert (len(out), len(errors)) == (counts.completed, counts.failed)
        for line in out:
            usage = line["response"]["body"]["usage"]
            assert usage["completion_tokens"] == 24 and "cached_tokens" in usage["prompt_tokens_details"]
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0
        for name in ("batch-runner-0", "prefill-0", "decode-1", "nats-server"):  # each fault happened
            assert f"switchyard: {name} exited with code -9; restarting it" in output, output[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
