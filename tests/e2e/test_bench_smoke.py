"""`switchyard bench overhead` runs end to end and writes what it promises.

It asserts no speed (performance claims live in the benchmark's own output), only that
the benchmark works: a table on stdout, results.json with every figure, three PNGs.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from switchyard import procs


def test_bench_overhead_quick_run_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "overhead"
    command = procs.service_command(
        "bench",
        "overhead",
        "--out",
        str(out),
        "--ttft-requests",
        "15",
        "--seconds",
        "1",
        "--concurrency",
        "1,8",
        "--stream-tokens",
        "32",
    )
    try:  # under pytest's 120 s, so that a hung run fails here, with what it printed
        run = subprocess.run(command, capture_output=True, text=True, timeout=100, env=procs.child_env())
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"bench overhead did not finish in 100 s; stdout: {hung.stdout!r}; stderr: {hung.stderr!r}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "time to first token" in run.stdout and "streamed tokens/s" in run.stdout
    results = json.loads((out / "results.json").read_text())
    assert results["ttft_ms"]["fabric_p50"] > 0 and results["ttft_ms"]["engine_alone_p50"] > 0
    assert [row["streams"] for row in results["throughput"]] == [1, 8]
    assert all(row["tokens"] > 0 and row["engine_alone_tokens_per_s"] > 0 for row in results["throughput"])
    assert set(results["rss_mib"]) == {"scheduler", "prefill-0", "decode-0", "ingress", "batch-runner", "nats-server"}
    for name in ("ttft.png", "throughput.png", "memory.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
