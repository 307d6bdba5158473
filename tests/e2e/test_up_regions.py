"""``switchyard up --regions us,eu,ap``: three regions on this machine from one command, a
session carried from one region's ingress to another's, and everything stopped by Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import psutil

from switchyard import procs
from tests.e2e.test_up import _wait_ready_line


def test_up_runs_three_regions_and_stops_them_all(tmp_path) -> None:
    port = procs.free_port()
    proc = subprocess.Popen(
        procs.service_command(
            "up",
            "--regions",
            "us,eu,ap",
            "--region-rtt-ms",
            "us-eu=30,us-ap=70,eu-ap=140",
            "--port",
            str(port),
            "--data-dir",
            str(tmp_path / "data"),
            "--log-level",
            "warning",
            "--report-interval-s",
            "0.2",
            "--summary-interval-s",
            "0.2",
            "--sim-prefill-per-token-s",
            "0.0002",
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=procs.child_env(),
        start_new_session=True,
    )
    try:
        line = _wait_ready_line(proc, 90)
        for i, region in enumerate(["us", "eu", "ap"]):
            assert f"{region} http://127.0.0.1:{port + i}/v1" in line
        descendants = psutil.Process(proc.pid).children(recursive=True)
        commands = [" ".join(p.cmdline()) for p in descendants]
        assert sum("nats-server" in c for c in commands) == 3
        assert sum("wan-relay" in c for c in commands) == 3
        for region in ("us", "eu", "ap"):
            assert any(f"--child {region}-scheduler" in c for c in commands)
        us, eu = (
            openai.OpenAI(base_url=f"http://127.0.0.1:{port + i}/v1", api_key="unused", max_retries=0) for i in (0, 1)
        )
        # Each ingress hears the others before the session moves. Alone this takes a few seconds;
        # under `make test` the other process may be booting two vLLM engines on the same two
        # cores (58 s once), so the wait is for liveness, not speed.
        deadline = time.monotonic() + 120
        while 'switchyard_region_alive{region="us"} 1.0' not in httpx.get(f"http://127.0.0.1:{port + 1}/metrics").text:
            assert time.monotonic() < deadline, "eu's ingress never heard us"
            time.sleep(0.2)
        text = " ".join(f"w{i * 31 % 997}" for i in range(500))
        headers = {"x-session-affinity": "roaming"}
        first = us.chat.completions.create(
            model="switchyard-sim", max_tokens=4, messages=[{"role": "user", "content": text}], extra_headers=headers
        )
        time.sleep(1.0)  # the placement crosses; us's summaries show it idle again
        second = eu.chat.completions.create(
            model="switchyard-sim",
            max_tokens=4,
            messages=[{"role": "user", "content": text + " more"}],
            extra_headers=headers,
        )
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 32
        metrics = httpx.get(f"http://127.0.0.1:{port + 1}/metrics").text
        assert 'switchyard_region_routes_total{reason="session",region="us"} 1.0' in metrics
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0
    left = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline()) for p in left]
