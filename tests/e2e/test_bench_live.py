"""`switchyard bench live` replays a (tiny, synthetic) trace through the real stack and
its simulation, and writes both. No speed is asserted: only that the replay is whole
and that the prefix sharing of the trace reaches the real cache."""

from __future__ import annotations

import json
import subprocess

import pytest

from switchyard import procs
from switchyard.bench.live import Scaling
from switchyard.bench.traces import TraceRequest


def _trace(path) -> None:
    rows = []
    for i in range(24):
        shared = [1, 2, 3, 4]  # every request opens with the same 2048-token prefix
        rows.append(
            {
                "timestamp": i * 100,
                "input_length": 512 * 6,
                "output_length": 64,
                "hash_ids": [*shared, 1000 + 2 * i, 1001 + 2 * i],
            }
        )
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_scaled_prompts_share_exactly_the_trace_prefixes() -> None:
    s = Scaling(time=0.1, tokens=16)
    a = TraceRequest(0.0, 1500, 10, (7, 8, 9))
    b = TraceRequest(1.0, 1100, 10, (7, 8, 5))
    pa, pb = s.prompt(a), s.prompt(b)
    assert len(pa) == 94 and len(pb) == 69  # ceil(1500/16), ceil(1100/16)
    assert pa[:64] == pb[:64] and pa[64:69] != pb[64:69]  # two shared blocks of 32, then apart


@pytest.mark.parametrize(
    ("fleet", "policies"),
    [
        ((), ["least_tokens", "switchyard"]),
        (("--colocated",), ["switchyard"]),
        (("--lendable",), ["llmd", "switchyard"]),
    ],
    ids=["disaggregated", "colocated", "lendable"],
)
def test_bench_live_replays_through_the_stack_and_its_simulation(tmp_path, fleet, policies) -> None:
    trace = tmp_path / "tiny.jsonl"
    _trace(trace)
    out = tmp_path / "live"
    run = subprocess.run(
        procs.service_command(
            "bench",
            "live",
            "--trace",
            str(trace),
            "--out",
            str(out),
            "--prefill",
            "2",
            "--decode",
            "1",
            *fleet,
            "--time-scale",
            "0.05",
            "--policies",
            ",".join(policies),
        ),
        capture_output=True,
        text=True,
        timeout=240,
        env=procs.child_env(),
    )
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads((out / "results.json").read_text())
    assert [row["policy"] for row in rows] == policies
    for row in rows:
        live, sim = row["live"], row["sim"]
        assert live["completed"] == sim["completed"] == 24
        assert live["ttft_p50_s"] > 0 and live["tpot_p50_s"] > 0
        assert live["cache_hit_ratio"] > 0.3 and sim["cache_hit_ratio"] > 0.3  # the shared prefix is found
    assert (out / "live_vs_sim.png").read_bytes()[:4] == b"\x89PNG"
