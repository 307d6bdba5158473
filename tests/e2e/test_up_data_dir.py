"""``switchyard up --data-dir``: what JetStream holds (here, an uploaded file) outlives a full
stop and start of the stack, and one data folder serves one ``up`` at a time."""

from __future__ import annotations

import signal
import subprocess

import openai

from switchyard import procs
from tests.e2e.test_up import READY_S, _start_up, _wait_ready_line


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_files_survive_a_restart_of_the_whole_stack(tmp_path):
    data_dir = str(tmp_path / "data")
    port = procs.free_port()
    first = _start_up(port, "--data-dir", data_dir)
    try:
        assert f"data in {data_dir}" in _wait_ready_line(first, READY_S)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
        uploaded = client.files.create(file=("input.jsonl", b'{"custom_id": "1"}\n'), purpose="batch")
        second = subprocess.run(
            procs.service_command("up", "--port", str(procs.free_port()), "--data-dir", data_dir),
            capture_output=True,
            text=True,
            timeout=60,
            env=procs.child_env(),
        )
        assert second.returncode == 1 and "in use by another `switchyard up`" in second.stdout, second.stdout
    finally:
        _stop(first)
    assert first.returncode == 0
    again = _start_up(port, "--data-dir", data_dir)
    try:
        _wait_ready_line(again, READY_S)
        assert client.files.retrieve(uploaded.id) == uploaded
        assert client.files.content(uploaded.id).content == b'{"custom_id": "1"}\n'
    finally:
        _stop(again)
