"""A batch through ``switchyard up`` as a user runs it: the stack starts a batch runner (its
own process and NATS user), and the openai client's batch completes."""

from __future__ import annotations

import json
import signal
import time

import openai
import psutil

from switchyard import procs
from tests.e2e.test_up import READY_S, _start_up, _wait_ready_line


def test_up_runs_a_batch_to_completed():
    port = procs.free_port()
    proc = _start_up(port)
    try:
        _wait_ready_line(proc, READY_S)
        names = " ".join(" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True))
        assert names.count("--child batch-runner") == 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        body = {"model": "switchyard-sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        data = b"".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}).encode()
            + b"\n"
            for i in range(5)
        )
        file = client.files.create(file=("in.jsonl", data), purpose="batch")
        batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while (batch := client.batches.retrieve(batch.id)).status != "completed":
            assert time.monotonic() < deadline, batch.status
            time.sleep(0.2)
        out = [json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == [f"r{i}" for i in range(5)]
        assert all(x["response"]["body"]["usage"]["completion_tokens"] == 3 for x in out)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
