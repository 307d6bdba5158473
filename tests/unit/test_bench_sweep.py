"""``switchyard bench sim --sweep``: every policy at every load, sweep.json, the load curves, and
where each policy saturates. Traces are tiny and synthetic."""

from __future__ import annotations

import json

import pytest

from switchyard.bench.sweep import saturation
from tests.unit.test_bench_sim import run_sim_args, write_trace

PNG = b"\x89PNG\r\n\x1a\n"


def steady(n: int = 300, gap_s: float = 1.0) -> list[dict]:
    """Prompts of 6,000 tokens (about 0.5 s of prefill) every ``gap_s``, half sharing a prefix."""
    return [
        {
            "timestamp": int(1000 * i * gap_s),
            "input_length": 6000,
            "output_length": 10,
            "hash_ids": [0 if i % 2 else 10_000 + i] + [i * 100 + j for j in range(1, 12)],
        }
        for i in range(n)
    ]


def point(load: float, goodput: float, fraction: float) -> dict:
    return {"offered_rps": load, "goodput_rps": goodput, "goodput_fraction": fraction}


def test_saturation_is_the_goodput_peak_and_the_knee_the_last_load_near_light_load_fractions():
    points = [point(0.5, 0.5, 1.0), point(1, 0.95, 0.95), point(2, 1.7, 0.85), point(3, 1.2, 0.4), point(4, 1.4, 0.35)]
    s = saturation(points)
    assert (s["peak_offered_rps"], s["peak_goodput_rps"], s["saturated"]) == (2, 1.7, True)
    assert s["knee_offered_rps"] == 1  # 0.85 < 0.9 x 1.0; the later dip back does not count
    assert saturation(points[:2])["saturated"] is False  # still climbing at the heaviest load


def test_a_sweep_writes_sweep_json_and_both_plots_and_finds_each_saturation(tmp_path):
    trace = write_trace(tmp_path / "steady.jsonl", steady())
    # Two policies that saturate: switchyard, SLO-aware, sheds what cannot make it and may
    # keep climbing past the sweep's heaviest load.
    flags = ("--policies", "round_robin,least_tokens", "--prefill", "1", "--decode", "1", "--limit", "200")
    flags += ("--sweep", "4,1,0.4,0.2", "--jobs", "1")
    run_sim_args(trace, tmp_path / "a", *flags)
    record = json.loads((tmp_path / "a" / "sweep.json").read_text())
    assert list(record["policies"]) == ["round_robin", "least_tokens"]
    for entry in record["policies"].values():
        loads = [p["offered_rps"] for p in entry["points"]]
        assert loads == sorted(loads) and len(loads) == 4
        assert loads[0] == pytest.approx(200 / 199 / 4)  # 200 requests over 199 s, stretched 4 x
        for p in entry["points"]:
            assert {"goodput_rps", "goodput_fraction", "ttft_p50_s", "ttft_p90_s", "tpot_p90_s"} <= p.keys()
            assert {"cache_hit_ratio", "rejected", "time_scale"} <= p.keys()
        s = entry["saturation"]
        # ~2 prompts/s of prefill: goodput peaks past 1 req/s offered and falls off at 5 req/s
        assert s["saturated"] and 1 <= s["peak_offered_rps"] < loads[-1]
        assert s["knee_offered_rps"] <= s["peak_offered_rps"]
    for name in ("goodput_vs_load.png", "ttft_p90_vs_load.png"):
        assert (tmp_path / "a" / name).read_bytes()[:8] == PNG
    # In two processes, runs end in any order: the file is the same.
    run_sim_args(trace, tmp_path / "b", *flags[:-1], "2")
    assert (tmp_path / "a" / "sweep.json").read_bytes() == (tmp_path / "b" / "sweep.json").read_bytes()


def test_a_sweep_refuses_a_scale_that_is_not_positive(tmp_path, capsys):
    trace = write_trace(tmp_path / "steady.jsonl", steady(5))
    with pytest.raises(SystemExit):
        run_sim_args(trace, tmp_path / "out", "--sweep", "1,0")
    assert "time scales must be positive" in capsys.readouterr().err
