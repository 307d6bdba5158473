"""``switchyard up`` as a user runs it: one command, a URL, Ctrl-C, nothing left behind."""

from __future__ import annotations

import select
import signal
import subprocess
import time

import openai
import psutil
import pytest

from switchyard import procs


def _start_up(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        procs.service_command("up", "--port", str(port), "--log-level", "warning", "--report-interval-s", "0.2"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=procs.child_env(),
        start_new_session=True)


def _wait_ready_line(proc: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            seen.append(line)
            if "is ready" in line:
                return line
        if proc.poll() is not None:
            break
    raise AssertionError(f"no ready line; output so far: {''.join(seen)}")


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM])
def test_up_serves_and_stops_cleanly(stop_signal):
    port = procs.free_port()
    proc = _start_up(port)
    try:
        line = _wait_ready_line(proc, 60)
        assert f"http://127.0.0.1:{port}/v1" in line
        descendants = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in descendants)
        assert "nats-server" in names and "scheduler" in names and "ingress" in names
        assert names.count("--role prefill") == 1 and names.count("--role decode") == 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="switchyard-sim", max_tokens=5,
                                               messages=[{"role": "user", "content": "hi"}])
        assert reply.usage.completion_tokens == 5
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(descendants, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_a_busy_port():
    with procs.nats_server() as busy:  # something already listens on this port
        proc = subprocess.run(procs.service_command("up", "--port", str(busy.port), "--ready-timeout-s", "20",
                                                    "--log-level", "error"),
                              capture_output=True, text=True, timeout=60, env=procs.child_env())
    assert proc.returncode == 1
    assert "ingress exited" in proc.stdout, proc.stdout
