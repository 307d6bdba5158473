"""``switchyard up --schedulers 2``: the active scheduler dies, the standby serves within
seconds, before the supervisor could have brought the dead one back.

The active replica is found by freezing one (SIGSTOP): a frozen standby changes nothing
(the other answers at once); a frozen active one answers nothing, so a request that
succeeds while it is frozen was served by the replica that took its lease over. The
frozen active one is then killed, as a crashed one would be, and restarted by ``up``."""

from __future__ import annotations

import select
import signal
import subprocess
import time

import openai
import psutil

from switchyard import procs


def _start_up(port: int) -> subprocess.Popen:
    command = procs.service_command(
        "up", "--port", str(port), "--schedulers", "2", "--log-level", "warning", "--report-interval-s", "0.2"
    )
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.child_env(),
        start_new_session=True,
    )


def _wait_for_line(proc: subprocess.Popen, needle: str, timeout_s: float) -> str:
    deadline, seen = time.monotonic() + timeout_s, []
    while time.monotonic() < deadline and proc.poll() is None:
        ready, _, _ = select.select([proc.stdout], [], [], 0.2)
        if ready:
            line = proc.stdout.readline()
            seen.append(line)
            if needle in line:
                return line
    raise AssertionError(f"no line with {needle!r} within {timeout_s} s; output: {''.join(seen)}")


def _scheduler(proc: subprocess.Popen, index: int) -> psutil.Process:
    name = f"--child scheduler-{index}"
    return next(p for p in psutil.Process(proc.pid).children(recursive=True) if name in " ".join(p.cmdline()))


def _replacement(proc: subprocess.Popen, index: int, dead: psutil.Process) -> psutil.Process | None:
    try:
        found = _scheduler(proc, index)
    except StopIteration:
        return None
    return found if found.pid != dead.pid else None


def _served_within(port: int, timeout_s: float) -> float:
    """Seconds until a completion succeeds (a 429 or 503 meanwhile is retried)."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=10)
    started = time.monotonic()
    while True:
        try:
            reply = client.chat.completions.create(
                model="switchyard-sim", max_tokens=3, messages=[{"role": "user", "content": "still there?"}]
            )
            assert reply.usage.completion_tokens == 3
            return time.monotonic() - started
        except openai.APIError:
            if time.monotonic() - started > timeout_s:
                raise
            time.sleep(0.1)


def test_the_standby_serves_within_seconds_when_the_active_scheduler_dies():
    port = procs.free_port()
    proc = _start_up(port)
    try:
        _wait_for_line(proc, "is ready", 60)
        _served_within(port, 5)
        first, second = _scheduler(proc, 0), _scheduler(proc, 1)
        first.suspend()
        if _served_within(port, 5) < 0.5:  # first stands by: second answered at once
            first.resume()
            time.sleep(0.3)  # first hears the submits again before second stops answering
            victim = second
            victim.suspend()
            took_over = _served_within(port, 5)
        else:
            victim, took_over = first, None
        # Frozen, the victim answers nothing: the other replica served. Now it dies for good.
        victim.send_signal(signal.SIGKILL)
        line = _wait_for_line(proc, "restarting", 10)
        assert "scheduler-" in line and "exited" in line
        assert _served_within(port, 5) < 5
        if took_over is not None:
            print(f"standby served {took_over:.2f} s after the active scheduler froze")
        deadline = time.monotonic() + 10  # and up brings the dead one back, as a standby
        while _replacement(proc, 0 if victim is first else 1, victim) is None:
            assert time.monotonic() < deadline, "the dead scheduler was not restarted"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
