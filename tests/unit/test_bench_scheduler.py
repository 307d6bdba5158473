"""``bench scheduler`` on a tiny fleet: the results' shape, and placements that a seed fixes."""

from __future__ import annotations

import json

import pytest

from switchyard.bench.scheduler_bench import BenchSettings, Workload, benchmark, check_digests, deep_bytes, table
from switchyard.cli import build_parser

TINY = BenchSettings(prefill=6, decode=2, entries=3_000, requests=200, warmup=50, conversations=200)
POLICIES = ["switchyard", "sglang_cache_aware"]


def _quiet(line: str) -> None:
    pass


def test_results_have_every_figure_per_policy() -> None:
    results = benchmark(TINY, POLICIES, _quiet)
    assert [r["policy"] for r in results["policies"]] == POLICIES
    index = results["index"]
    assert 0.9 * TINY.entries <= index["entries"] <= TINY.entries
    assert index["entries"] == index["entries_by_caches"]  # the index agrees with the workers' caches
    assert 0 < index["distinct_blocks"] <= index["entries"]
    assert index["bytes_per_entry"] > 0 and index["bytes"] >= index["bytes_per_entry"]
    assert index["lookup_p50_us"] > 0 and index["lookup_slots_p50_us"] > 0
    assert index["bytes_after_run"] > 0
    for r in results["policies"]:
        # every timed request placed twice (prefill, then decode), nothing lost
        assert r["dispatches"].get("prefill", 0) >= TINY.requests and r["rejected"] == r["failed"] == 0
        assert r["decisions"] == sum(r["dispatches"].values())
        assert r["decisions_per_s"] > 0 and r["submit_p99_ms"] >= r["submit_p50_ms"] > 0
        assert r["kv_blocks"] > 0 and 0 < r["prefill_hit_ratio"] < 1  # prompts partly hit the index
        assert r["placements"] == 2 * (TINY.requests + TINY.warmup)
        assert set(r["by_method"]) >= {"submit", "on_event", "on_kv_events", "tick"}
    json.dumps(results)  # what results.json holds
    printed = table(results)
    assert all(f"| {policy} |" in printed for policy in POLICIES)


def test_a_seed_fixes_the_placements() -> None:
    first = benchmark(TINY, POLICIES, _quiet)
    again = benchmark(TINY, POLICIES, _quiet)
    other = benchmark(BenchSettings(**{**TINY.__dict__, "seed": 1}), POLICIES, _quiet)
    digests = [[r["digest"] for r in run["policies"]] for run in (first, again, other)]
    assert digests[0] == digests[1]
    assert all(a != b for a, b in zip(digests[0], digests[2], strict=True))
    assert check_digests(again, first) == 0
    assert check_digests(other, first) == 1  # other settings: nothing to compare, says so


def test_check_digest_catches_a_different_placement() -> None:
    results = benchmark(TINY, ["switchyard"], _quiet)
    changed = json.loads(json.dumps(results))
    changed["policies"][0]["digest"] = "0" * 64
    assert check_digests(results, changed) == 1


def test_the_workload_extends_prefixes() -> None:
    workload = Workload(TINY)
    prompts = [workload.next() for _ in range(500)]
    firsts = {p.keys[0] for p in prompts}
    assert len(firsts) <= TINY.system_prompts  # every prompt starts with a shared system prompt
    seen: set[tuple[int, ...]] = set()
    extended = 0
    for p in prompts:
        extended += any(tuple(p.keys[:n]) in seen for n in range(len(p.keys) - 1, 7, -1))
        seen.update(tuple(p.keys[:n]) for n in range(1, len(p.keys) + 1))
    assert extended > 50  # later turns continue an earlier prompt beyond its system prompt


def test_deep_bytes_counts_shared_objects_once() -> None:
    shared = list(range(1000, 2000))
    alone, _ = deep_bytes([shared])
    twice, _ = deep_bytes([shared, shared])
    assert twice - alone == 8  # one more pointer, not a second list
    assert deep_bytes({"a-worker": 1})[0] > deep_bytes({1: 1})[0]  # a str key is counted too


def test_the_cli_runs_this_module() -> None:
    args = build_parser().parse_args(["bench", "scheduler", "--prefill", "4", "--policies", "switchyard"])
    assert args.bench == "scheduler_bench" and args.prefill == 4


def test_repeats_report_the_median_run_with_every_run_beside_it() -> None:
    results = benchmark(TINY, ["switchyard"], _quiet, repeats=3)
    (r,) = results["policies"]
    each = sorted(run["decisions_per_s"] for run in r["runs"])
    assert results["repeats"] == 3 and len(each) == 3
    assert r["decisions_per_s"] == each[1]  # the median run's figures are the policy's
    assert "3: " in table(results)
    with pytest.raises(ValueError, match="at least 1"):
        benchmark(TINY, ["switchyard"], _quiet, repeats=0)


def test_a_missing_digest_file_is_refused_before_the_run(tmp_path) -> None:
    from switchyard.bench import scheduler_bench

    argv = ["bench", "scheduler", "--out", str(tmp_path), "--check-digest", str(tmp_path / "none.json")]
    args = build_parser().parse_args(argv)
    with pytest.raises(SystemExit, match="no such file"):
        scheduler_bench.run(args)
    assert not (tmp_path / "results.json").exists()
