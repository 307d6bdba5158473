"""``switchyard bench matrix``: a sweep per case, matrix.json's summaries and comparisons read off
those sweeps' points. The trace is tiny and synthetic (the real ones take minutes a case)."""

from __future__ import annotations

import json

import pytest

from switchyard.bench import matrix
from tests.unit.test_bench_sim import write_trace
from tests.unit.test_bench_sweep import PNG, steady

CASES = "mooncake-6p2d-device,mooncake-colocated8-tiered"


def test_cases_are_named_by_trace_shape_and_cache_and_unknown_ones_refused():
    names = [c.name for c in matrix.CASES]
    assert names[:2] == ["mooncake-6p2d-device", "mooncake-6p2d-tiered"]
    assert {"mooncake-4p4d-device", "mooncake-colocated8-tiered", "azure-6p2d-device", "azure-colocated8-device"} <= {
        *names
    }
    assert len(names) == len(set(names)) == 9
    lendable = matrix.select_cases("mooncake-6p2d_lendable-device")[0]
    assert lendable.sim_argv()[-1] == "--lendable" and not lendable.colocated  # prefill workers of role both
    assert [c.name for c in matrix.select_cases("azure-6p2d-device,mooncake-4p4d-tiered")] == [
        "mooncake-4p4d-tiered",
        "azure-6p2d-device",
    ]  # the matrix's order
    with pytest.raises(ValueError, match="unknown case 'mooncake-9p9d-device'"):
        matrix.select_cases("mooncake-9p9d-device")


def test_a_matrix_writes_a_sweep_per_case_and_compares_switchyard_with_the_best_peer(tmp_path):
    trace = write_trace(tmp_path / "steady.jsonl", steady())
    out = tmp_path / "m"
    argv = ["--out", str(out), "--mooncake", str(trace), "--cases", CASES, "--limit", "200"]
    argv += ["--policies", "dynamo_kv,switchyard", "--mooncake-sweep", "1,0.3", "--jobs", "1"]
    assert matrix.main(argv) == 0
    record = json.loads((out / "matrix.json").read_text())
    assert list(record["cases"]) == CASES.split(",")
    assert (out / "matrix_goodput.png").read_bytes()[:8] == PNG
    for name, case in record["cases"].items():
        sweep = json.loads((out / name / "sweep.json").read_text())
        assert case["requests"] == 200 and case["time_scales"] == [1, 0.3]
        for policy, summary in case["policies"].items():
            points = sweep["policies"][policy]["points"]
            assert {"completed", "completed_fraction", "rejected", "failed", "cache_hit_ratio"} <= points[0].keys()
            peak = max(points, key=lambda p: p["goodput_rps"])
            assert summary["peak_goodput_rps"] == peak["goodput_rps"]
            assert summary["peak_completed_fraction"] == peak["completed"] / 200
            assert (summary["light_goodput_rps"], summary["light_ttft_p90_s"]) == (
                points[0]["goodput_rps"],
                points[0]["ttft_p90_s"],
            )
        c, ours, peer = case["comparison"], case["policies"]["switchyard"], case["policies"]["dynamo_kv"]
        assert c["best_peer"] == c["light_best_peer"] == "dynamo_kv"  # the only peer here
        assert c["goodput_ratio"] == pytest.approx(ours["peak_goodput_rps"] / peer["peak_goodput_rps"])
        there = next(
            p for p in sweep["policies"]["switchyard"]["points"] if p["offered_rps"] == peer["peak_offered_rps"]
        )
        assert c["at_peer_peak_goodput_rps"] == {"ours": there["goodput_rps"], "peer": peer["peak_goodput_rps"]}
        assert c["at_peer_peak_ttft_p90_s"] == {"ours": there["ttft_p90_s"], "peer": peer["peak_ttft_p90_s"]}
        assert c["own_peak_ttft_p90_s"] == {"ours": ours["peak_ttft_p90_s"], "peer": peer["peak_ttft_p90_s"]}
        assert c["light_goodput_rps"] == {"ours": ours["light_goodput_rps"], "peer": peer["light_goodput_rps"]}
    assert record["cases"]["mooncake-colocated8-tiered"]["fleet"]["host_cache_blocks"] == 4000


def sweep_entry(goodputs: list[float], ttfts: list[float]) -> dict:
    """A sweep.json policy entry at loads 1, 2, 3 (its saturation left to bench.sweep)."""
    from switchyard.bench.sweep import saturation

    points = [
        {"offered_rps": load, "goodput_rps": g, "goodput_fraction": g / load, "ttft_p90_s": t}
        | {"completed_fraction": 1.0}
        for load, g, t in zip((1.0, 2.0, 3.0), goodputs, ttfts, strict=True)
    ]
    return {"points": points, "saturation": saturation(points)}


def test_the_best_peer_is_the_highest_peak_and_the_light_best_may_be_another():
    policies = {
        "dynamo_kv": sweep_entry([1.0, 1.5, 1.2], [0.3, 0.9, 2.0]),
        "llmd": sweep_entry([0.9, 1.8, 1.0], [0.5, 1.1, 3.0]),
        "switchyard": sweep_entry([1.0, 1.9, 2.7], [0.2, 0.6, 1.0]),
    }
    c = matrix.compare(policies)
    assert c is not None
    assert (c["best_peer"], c["light_best_peer"]) == ("llmd", "dynamo_kv")
    assert c["goodput_ratio"] == pytest.approx(2.7 / 1.8)
    assert c["peak_offered_rps"] == {"ours": 3.0, "peer": 2.0}
    assert c["at_peer_peak_goodput_rps"] == {"ours": 1.9, "peer": 1.8}
    assert c["at_peer_peak_ttft_p90_s"] == {"ours": 0.6, "peer": 1.1}
    assert c["own_peak_ttft_p90_s"] == {"ours": 1.0, "peer": 1.1}
    assert c["best_peer_own_peak_ttft_p90_s"] == 0.9  # dynamo_kv's, at its own peak
    assert c["light_goodput_rps"] == {"ours": 1.0, "peer": 1.0}
    assert matrix.compare({"dynamo_kv": policies["dynamo_kv"]}) is None  # no switchyard: nothing to compare


def test_summarize_only_rebuilds_matrix_json_from_the_sweeps_already_there(tmp_path):
    trace = write_trace(tmp_path / "steady.jsonl", steady())
    out = tmp_path / "m"
    argv = ["--out", str(out), "--mooncake", str(trace), "--cases", "mooncake-6p2d-device", "--limit", "100"]
    argv += ["--policies", "dynamo_kv,switchyard", "--mooncake-sweep", "1,0.5", "--jobs", "1"]
    assert matrix.main(argv) == 0
    first = (out / "matrix.json").read_text()
    (out / "matrix.json").unlink()
    assert matrix.main([*argv, "--summarize-only", "--mooncake", str(tmp_path / "no-such-trace.jsonl")]) == 0
    assert (out / "matrix.json").read_text() == first


def test_merge_reruns_one_policy_and_keeps_the_others_results(tmp_path):
    trace = write_trace(tmp_path / "steady.jsonl", steady())
    out = tmp_path / "m"
    argv = ["--out", str(out), "--mooncake", str(trace), "--cases", "mooncake-6p2d-device", "--limit", "100"]
    argv += ["--mooncake-sweep", "1,0.5", "--jobs", "1"]
    assert matrix.main([*argv, "--policies", "dynamo_kv,switchyard"]) == 0
    sweep_path = out / "mooncake-6p2d-device" / "sweep.json"
    both = json.loads(sweep_path.read_text())
    fake = both["policies"]["dynamo_kv"] | {"marker": "kept from the first run"}
    sweep_path.write_text(json.dumps(both | {"policies": {"dynamo_kv": fake, "switchyard": {}}}))
    assert matrix.main([*argv, "--policies", "switchyard", "--merge"]) == 0
    merged = json.loads(sweep_path.read_text())
    assert list(merged["policies"]) == ["dynamo_kv", "switchyard"]
    assert merged["policies"]["dynamo_kv"]["marker"] == "kept from the first run"  # not run again
    assert merged["policies"]["switchyard"] == both["policies"]["switchyard"]  # run again: the same
    record = json.loads((out / "matrix.json").read_text())
    assert record["cases"]["mooncake-6p2d-device"]["comparison"]["best_peer"] == "dynamo_kv"
    # Another fleet or other scales do not merge: it says what differs.
    with pytest.raises(SystemExit, match="another time_scales"):
        matrix.main([*argv[:-4], "--mooncake-sweep", "1,0.4", "--jobs", "1", "--policies", "switchyard", "--merge"])
    without = json.loads(sweep_path.read_text())
    assert list(without["policies"]) == ["dynamo_kv", "switchyard"]  # untouched by the refused run
