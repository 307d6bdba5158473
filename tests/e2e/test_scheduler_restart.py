"""``switchyard up`` with one scheduler and no standby: the scheduler is SIGKILLed while
requests wait in its queue, and ``up`` starts it again. What it had only in memory (the
queue, requests waiting for decode room) is gone with it; each ingress hears the new
scheduler's roll call and submits again every stream not yet on a worker, while streams on
workers are adopted by the new scheduler or, stalled, continued elsewhere. Every client
gets its whole greedy text, in seconds, not a 60 s timeout."""

from __future__ import annotations

import concurrent.futures
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil

from switchyard import procs

STREAMS = 10


def _start_up(port: int, log: Path) -> subprocess.Popen:
    # One prefill at a time (budget 64, prompts of ~45 tokens), 0.4 s each: a queue forms.
    command = procs.service_command(
        "up",
        *("--port", str(port), "--log-level", "warning", "--report-interval-s", "0.2"),
        *("--token-budget", "64", "--decode-overcommit", "50"),
        *("--sim-prefill-base-s", "0.4", "--sim-decode-step-base-s", "0.01"),
    )
    with log.open("w") as out:
        return subprocess.Popen(command, stdout=out, stderr=out, env=procs.child_env(), start_new_session=True)


def _wait_ready(port: int, log: Path, timeout_s: float = 60) -> None:
    """Healthy, and up says it is ready: until then it takes a dead child for a failed start."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200 and (
                "Switchyard is ready" in log.read_text()
            ):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"the stack did not become ready:\n{log.read_text()[-3000:]}")


def _complete(port: int, index: int, submitted: threading.Semaphore | None) -> tuple[str, float]:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
    begun = time.monotonic()
    if submitted is not None:
        submitted.release()
    reply = client.completions.create(
        model="switchyard-sim", prompt=f"yard {index} " * 20, max_tokens=40, temperature=0
    )
    return reply.choices[0].text, time.monotonic() - begun


def test_requests_queued_at_a_scheduler_that_dies_complete_after_its_restart(tmp_path):
    port, log = procs.free_port(), tmp_path / "up.log"
    up = _start_up(port, log)
    try:
        _wait_ready(port, log)
        reference = [_complete(port, i, None)[0] for i in range(STREAMS)]
        scheduler = next(
            p for p in psutil.Process(up.pid).children(recursive=True) if "--child scheduler" in " ".join(p.cmdline())
        )
        submitted = threading.Semaphore(0)
        with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
            runs = [pool.submit(_complete, port, i, submitted) for i in range(STREAMS)]
            for _ in range(STREAMS):
                submitted.acquire(timeout=10)
            time.sleep(0.8)  # every one admitted; most wait in the queue
            scheduler.kill()
            results = [run.result(timeout=90) for run in runs]
        for (text, seconds), expected in zip(results, reference, strict=True):
            assert text == expected
            assert seconds < 40  # submitted again, not timed out
    finally:
        up.terminate()
        up.wait(30)
