"""``bench.simdoc``: docs/bench-sim.md's tables are generated from the runs' results, and the
committed doc is exactly what the committed results give."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from switchyard.bench import simdoc

ROOT = Path(__file__).resolve().parents[2]


def result(policy: str, hit: float, ttft_ms: tuple[float, float, float], **kw) -> dict:
    """One policy's object of a results.json, only the fields the tables read."""
    return {
        "policy": policy,
        "mode": "disaggregated",
        "requests": 1200,
        "rejected": 0,
        "cache_hit_ratio": hit,
        "hit_ratio_bound": 0.4,
        "hit_ratio_bound_fleet_cache": 0.35,
        "ttft_p50_s": ttft_ms[0] / 1e3,
        "ttft_p90_s": ttft_ms[1] / 1e3,
        "ttft_p99_s": ttft_ms[2] / 1e3,
        "tpot_p50_s": 0.0251,
        "tpot_p90_s": 0.0284,
        "tpot_p99_s": None,
        "goodput_rps": 2.666,
        "trace_span_s": 400.0,
        "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
        "dispatches": {"prefill": 1200, "decode": 1200},
        "index_entries": 36000,
        "index_bytes_per_block": 410.6,
        "fleet": {"roles": {"decode": 2, "prefill": 6}, "cache_blocks": 6000, "time_scale": 1.0}
        | {"local_prefill_max_tokens": 0},
    } | kw


def timing(policy: str, wall_s: float, decisions_per_s: float, us_per_submit: float) -> dict:
    submit = {"calls": 1200, "wall_s": 0.0, "us_per_call": us_per_submit}
    return {
        "policy": policy,
        "wall_s": wall_s,
        "decisions_per_s": decisions_per_s,
        "core_by_method": {"submit": submit},
    }


RUN = {
    "results": [
        result("round_robin", 0.1449, (1408.2, 4635.0, 10913.4), rejected=1234),
        result("switchyard", 0.2734, (702.6, 3087.0, 10277.0), index_bytes_per_block=None),
    ],
    "timing": [timing("round_robin", 5.44, 9559.2, 2381.4), timing("switchyard", 35.91, 896.0, 1640.0)],
}

POLICY_TABLE = """\
1,200 requests over 400 s (3.00 req/s); disaggregated, 6 `prefill` + 2 `decode` workers, 6,000 cache blocks each; \
goodput: TTFT <= 2 s and TPOT <= 50 ms.

| policy | hit | bound | fleet LRU | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | goodput req/s \
| rejected | index entries | B/block |
|---|---|---|---|---|---|---|---|---|---|
| round_robin | 0.145 | 0.400 | 0.350 | 1408 / 4635 / 10913 | 25 / 28 / - | 2.67 | 1,234 | 36,000 | 411 |
| switchyard | 0.273 | 0.400 | 0.350 | 703 / 3087 / 10277 | 25 / 28 / - | 2.67 | 0 | 36,000 | - |"""

TIMING_TABLE = """\
| policy | wall s (whole trace) | decisions/s | us per `submit` |
|---|---|---|---|
| round_robin | 5.4 | 9,559 | 2,381 |
| switchyard | 35.9 | 896 | 1,640 |"""


def test_a_results_json_becomes_the_expected_tables():
    assert simdoc.policy_table(RUN["results"]) == POLICY_TABLE
    assert simdoc.timing_table(RUN["timing"]) == TIMING_TABLE
    assert simdoc.tables(RUN) == f"{POLICY_TABLE}\n\n{TIMING_TABLE}\n"


def test_local_prefills_and_the_time_scale_show_only_when_the_run_has_them():
    fleet = RUN["results"][0]["fleet"] | {"time_scale": 0.008, "local_prefill_max_tokens": 2048}
    local = result("switchyard", 0.3, (583, 2599, 9961), fleet=fleet, dispatches={"local": 4797})
    caption, _, head, _, row = simdoc.policy_table([local]).split("\n")
    assert "; time scale 0.008; local prefill up to 2,048 uncached tokens;" in caption
    assert "| rejected | local prefills | index entries |" in head and "| 0 | 4,797 | 36,000 |" in row


def test_tiers_delays_and_goodput_fraction_show_only_when_the_run_has_them():
    fleet = RUN["results"][0]["fleet"] | {"cache_blocks": 878, "host_cache_blocks": 4000, "disk_cache_blocks": 0}
    fleet |= {"kv_event_delay_s": 0.05, "report_delay_s": 0.01}
    tiers = {"device": 0.1, "host": 0.15, "disk": 0.0}
    tiered = result("switchyard", 0.25, (700, 3000, 9000), fleet=fleet, cache_hit_ratio_by_tier=tiers)
    caption, _, head, _, row = simdoc.policy_table([tiered | {"goodput_fraction": 0.7564}]).split("\n")
    late = "KV events reach the core 50 ms late, worker events 10 ms"
    assert f"878 device + 4,000 host cache blocks each; {late};" in caption
    assert "| hit | hit device / host / disk | bound |" in head and "| 0.250 | 0.100 / 0.150 / 0.000 |" in row
    assert "| goodput req/s | goodput % | rejected |" in head and "| 2.67 | 75.6 | 0 |" in row
    # A run from before tiers and goodput_fraction: neither column (the committed doc's runs).
    assert "goodput %" not in simdoc.policy_table(RUN["results"]) and "device /" not in POLICY_TABLE


def test_rewrite_replaces_only_what_lies_between_the_markers():
    doc = (
        "# intro, kept\n"
        "<!-- bench-sim:begin demo -->\nstale table\n<!-- bench-sim:end demo -->\n"
        "between, kept\n"
        "<!-- bench-sim:begin demo:timing -->\n<!-- bench-sim:end demo:timing -->\n"
        "the end\n"
    )
    assert simdoc.rewrite(doc, {"demo": RUN}) == (
        "# intro, kept\n"
        f"<!-- bench-sim:begin demo -->\n{POLICY_TABLE}\n<!-- bench-sim:end demo -->\n"
        "between, kept\n"
        f"<!-- bench-sim:begin demo:timing -->\n{TIMING_TABLE}\n<!-- bench-sim:end demo:timing -->\n"
        "the end\n"
    )
    assert simdoc.run_names(doc) == ["demo"]


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ("<!-- bench-sim:begin other -->\n<!-- bench-sim:end other -->\n", "no results for run 'other'"),
        ("<!-- bench-sim:begin demo:plot -->\n<!-- bench-sim:end demo:plot -->\n", "unknown table 'plot'"),
        ("<!-- bench-sim:begin demo -->\nno end\n", "unpaired"),
    ],
)
def test_rewrite_refuses_a_marker_it_cannot_fill(doc, error):
    with pytest.raises(simdoc.DocError, match=error):
        simdoc.rewrite(doc, {"demo": RUN})


def test_the_command_keeps_the_runs_and_rewrites_the_doc_then_checks_it(tmp_path, capsys):
    run = tmp_path / "runs" / "demo"
    run.mkdir(parents=True)
    results = [r | {"utilisation": {"p0": 0.5}} for r in RUN["results"]]
    (run / "results.json").write_text(json.dumps(results))
    (run / "timing.json").write_text(json.dumps(RUN["timing"]))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench-sim:begin demo -->\n<!-- bench-sim:end demo -->\n")
    kept = tmp_path / "doc.results.json"
    paths = ["--doc", str(doc), "--results", str(kept)]
    assert simdoc.main([*paths, "--runs", str(tmp_path / "runs")]) == 0
    assert json.loads(kept.read_text()) == {"demo": RUN}  # utilisation is left out
    assert doc.read_text() == f"<!-- bench-sim:begin demo -->\n{POLICY_TABLE}\n<!-- bench-sim:end demo -->\n"
    assert simdoc.main([*paths, "--check"]) == 0  # from what was kept, without the runs
    doc.write_text(doc.read_text().replace("round_robin", "hand-edited"))
    assert simdoc.main([*paths, "--check"]) == 1 and "not what" in capsys.readouterr().err


def test_the_committed_doc_is_what_the_committed_results_give():
    doc = (ROOT / simdoc.DOC).read_text()
    runs = json.loads((ROOT / simdoc.RESULTS).read_text())
    assert simdoc.run_names(doc) == list(runs), "the kept runs are exactly the doc's"
    assert simdoc.rewrite(doc, runs) == doc, "run: python -m switchyard.bench.simdoc --runs bench/results/sim"
