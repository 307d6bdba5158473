"""``switchyard up`` as a user runs it: one command, a URL, Ctrl-C, nothing left behind."""

from __future__ import annotations

import select
import signal
import subprocess
import time

import httpx
import openai
import psutil
import pytest

from switchyard import procs

# How long a test waits for `up` to say it is ready, and how long `up` itself waits for its
# stack. Alone on this machine it takes about 5 s; beside a vLLM module's engines loading on the
# other CI worker, its ingress once logged its first line 59 s after the start, and the 60 s it
# had then ran out (the fresh-clone CI of 9aeb43d).
READY_S = 180


def up_command(port: int, *flags: str) -> list[str]:
    """``switchyard up`` as these tests start it: quiet, heartbeats every 0.2 s, ``READY_S``."""
    quick = ("--log-level", "warning", "--report-interval-s", "0.2", "--ready-timeout-s", str(READY_S))
    return procs.service_command("up", "--port", str(port), *quick, *flags)


def _start_up(port: int, *flags: str) -> subprocess.Popen:
    return subprocess.Popen(
        up_command(port, *flags),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.child_env(),
        start_new_session=True,
    )


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
        line = _wait_ready_line(proc, READY_S)
        assert f"http://127.0.0.1:{port}/v1" in line
        descendants = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(p.cmdline()) for p in descendants)
        assert "nats-server" in names and "scheduler" in names and "ingress" in names
        assert names.count("--child prefill-") == 1 and names.count("--child decode-") == 1
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="switchyard-sim", max_tokens=5, messages=[{"role": "user", "content": "hi"}]
        )
        assert reply.usage.completion_tokens == 5
        proc.send_signal(stop_signal)
        assert proc.wait(timeout=30) == 0
        _gone, alive = psutil.wait_procs(descendants, timeout=5)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_runs_a_colocated_fleet():
    """--colocated: workers of role both, no prefill or decode ones; the stack serves."""
    port = procs.free_port()
    proc = _start_up(port, "--prefill", "0", "--decode", "0", "--colocated", "2", "--tpot-slo-s", "0.05")
    try:
        _wait_ready_line(proc, READY_S)
        names = " ".join(" ".join(p.cmdline()) for p in psutil.Process(proc.pid).children(recursive=True))
        assert names.count("--child both-") == 2 and "--child prefill-" not in names and "--child decode-" not in names
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(
            model="switchyard-sim", max_tokens=6, messages=[{"role": "user", "content": "hi"}], stream=True
        )
        finishes = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
        assert finishes == ["length"]
        health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).json()
        assert (health["prefill_workers"], health["decode_workers"], health["colocated_workers"]) == (2, 2, 2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_a_busy_port():
    with procs.nats_server() as busy:  # something already listens on this port
        proc = subprocess.run(
            procs.service_command("up", "--port", str(busy.port), "--ready-timeout-s", "20", "--log-level", "error"),
            capture_output=True,
            text=True,
            timeout=60,
            env=procs.child_env(),
        )
    assert proc.returncode == 1
    assert "ingress exited" in proc.stdout, proc.stdout


def _child(proc: subprocess.Popen, word: str) -> psutil.Process:
    return next(p for p in psutil.Process(proc.pid).children(recursive=True) if word in " ".join(p.cmdline()))


def _complete(port: int) -> int:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10)
    reply = client.chat.completions.create(
        model="switchyard-sim", max_tokens=3, messages=[{"role": "user", "content": "still there?"}]
    )
    return reply.usage.completion_tokens


def test_a_crashed_scheduler_is_restarted_and_the_stack_serves_again():
    port = procs.free_port()
    proc = _start_up(port)
    try:
        _wait_ready_line(proc, READY_S)
        assert _complete(port) == 3
        victim = _child(proc, "switchyard scheduler")
        victim.kill()
        line = _wait_for_line(proc, "restarting", 10)
        assert "scheduler exited" in line
        deadline, served = time.monotonic() + 30, False
        while time.monotonic() < deadline and not served:
            try:
                served = _complete(port) == 3
            except openai.APIError:
                time.sleep(0.3)
        assert served
        assert _child(proc, "switchyard scheduler").pid != victim.pid
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)


def test_without_restarts_a_crash_stops_the_stack():
    port = procs.free_port()
    proc = subprocess.Popen(
        procs.service_command("up", "--port", str(port), "--log-level", "warning", "--max-restarts", "0"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.child_env(),
        start_new_session=True,
    )
    try:
        _wait_ready_line(proc, READY_S)
        _child(proc, "--child decode-").kill()
        assert proc.wait(timeout=30) == 1
        assert "stopping the stack" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            if needle in line:
                return line
    raise AssertionError(f"no line with {needle!r} within {timeout_s} s")
