"""The simulated half of ``bench federation``: the trace split, and small runs in virtual time.

Traces here are tiny and synthetic; each run takes well under a second.
"""

from __future__ import annotations

import argparse
import json

import pytest

from switchyard.bench.federation_sim import (
    FederationSettings,
    FederationSim,
    add_arguments,
    fleet_shapes,
    parse_rtts,
    recovery_s,
    run_sim,
    session_of,
    split_by_region,
)
from switchyard.bench.traces import TraceRequest

REGIONS = ("us", "eu", "ap")


def conversations(sessions: int = 8, turns: int = 4, gap_s: float = 4.0) -> list[dict]:
    """Chats behind one shared system block (id 0): each turn resends the history, 8 blocks
    of it at first and 4 more a turn, so a session's next turn is mostly cached where it ran."""
    rows = []
    for turn in range(turns):
        for s in range(sessions):
            ids = [0] + [1000 * (s + 1) + j for j in range(7 + 4 * turn)]
            rows.append(
                {
                    "timestamp": int(1000 * (turn * gap_s + 0.3 * s)),
                    "input_length": 512 * len(ids) - 100,
                    "output_length": 8,
                    "hash_ids": ids,
                }
            )
    return sorted(rows, key=lambda r: r["timestamp"])


def trace_requests(rows: list[dict]) -> list[TraceRequest]:
    return [
        TraceRequest(r["timestamp"] / 1000, r["input_length"], r["output_length"], tuple(r["hash_ids"])) for r in rows
    ]


def args_for(tmp_path, *extra: str) -> argparse.Namespace:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in conversations()))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(
        [
            "--trace",
            str(path),
            "--workers",
            "6",
            "--rate",
            "1",
            "--travel-share",
            "0.5",
            "--out",
            str(tmp_path / "out"),
            *extra,
        ]
    )


def settings(**kw) -> FederationSettings:
    return FederationSettings(
        regions=REGIONS,
        rtt_s=parse_rtts("us-eu=0.03,us-ap=0.07,eu-ap=0.14", REGIONS),
        shapes=fleet_shapes(REGIONS, 6, 0.5),
        time_scale=1.0,
        **kw,
    )


# --- the split ------------------------------------------------------------------------------------


def test_sessions_are_the_requests_sharing_their_second_block():
    requests = trace_requests(conversations(sessions=3, turns=2))
    assert [session_of(r, i) for i, r in enumerate(requests)] == [1000, 2000, 3000] * 2
    assert session_of(TraceRequest(0.0, 100, 1, (0,)), 7) == -8  # one block: a session of its own


def test_split_keeps_a_session_home_and_sends_some_later_turns_elsewhere():
    requests = trace_requests(conversations(sessions=40, turns=5))
    split = split_by_region(requests, REGIONS, (0.6, 0.25, 0.15), 0.3, seed=1)
    homes = {fr.session: fr.home for fr in split}
    assert all(fr.home == homes[fr.session] for fr in split)
    assert all(fr.ingress == fr.home for fr in split if fr.turn == 0)
    away = [fr for fr in split if fr.ingress != fr.home]
    assert away and all(fr.turn > 0 for fr in away)
    assert 0.15 < len(away) / sum(1 for fr in split if fr.turn > 0) < 0.45
    assert sum(1 for h in homes.values() if h == "us") > sum(1 for h in homes.values() if h == "ap")


def test_split_is_seeded_and_a_slice_splits_as_the_whole_does():
    requests = trace_requests(conversations(sessions=20, turns=4))
    whole = split_by_region(requests, REGIONS, (0.6, 0.25, 0.15), 0.2, seed=3)
    assert split_by_region(requests[:30], REGIONS, (0.6, 0.25, 0.15), 0.2, seed=3) == whole[:30]
    other = split_by_region(requests, REGIONS, (0.6, 0.25, 0.15), 0.2, seed=4)
    assert [fr.ingress for fr in other] != [fr.ingress for fr in whole]


def test_split_refuses_mismatched_weights():
    with pytest.raises(ValueError, match="weights"):
        split_by_region([], REGIONS, (0.5, 0.5), 0.2, seed=0)


def test_fleet_shapes_split_the_workers():
    shapes = fleet_shapes(REGIONS, 512, 0.75)
    assert sum(s.prefill + s.decode for s in shapes.values()) == 512
    assert [(s.prefill, s.decode) for s in shapes.values()] == [(128, 43), (128, 43), (128, 42)]
    skewed = fleet_shapes(REGIONS, 100, 0.5, [2, 1, 1])
    assert [s.prefill + s.decode for s in skewed.values()] == [50, 25, 25]


def test_rtts_need_every_pair():
    with pytest.raises(ValueError, match="eu-ap"):
        parse_rtts("us-eu=0.03,us-ap=0.07", REGIONS)


def test_recovery_is_the_end_of_the_last_bad_window():
    arrivals = [10.0 + i for i in range(12)]
    hurt = [True, True, False, False, False, False, False, False, False, False, False, False]
    assert recovery_s(hurt, arrivals, 10.0, window=4) == pytest.approx(4.0)  # window 1..4 is the last bad one
    assert recovery_s([False] * 12, arrivals, 10.0, window=4) == 0.0
    assert recovery_s([False] * 11 + [True], arrivals, 10.0, window=4) is None  # still bad at the end


# --- runs -------------------------------------------------------------------------------------------


def test_a_run_writes_every_figure_per_policy_and_run(tmp_path):
    args = args_for(tmp_path, "--kill", "eu", "--no-plots")
    results = run_sim(args, log=lambda _: None)
    written = json.loads((tmp_path / "out" / "results.json").read_text())
    assert written["settings"]["workers"] == 6
    for run in ("steady", "failover"):
        assert [r["policy"] for r in written[run]] == ["geo", "local", "blind"]
        for r in written[run]:
            for key in ("cache_hit_ratio", "ttft_p50_s", "ttft_p90_s", "goodput_rps", "spills", "cross_region_share"):
                assert key in r, key
            assert r["timing"]["router_decisions"] >= r["requests"]
            assert r["unfinished"] == 0  # nothing hangs, the kill included
            assert "ttft_samples_s" not in r
    for r in written["failover"]:
        assert set(r["failover"]) >= {"recovery_s", "failed_in_flight", "touched_after_kill"}
    assert len(results["steady"][0]["ttft_samples_s"]) == results["steady"][0]["completed"]


def test_local_never_crosses_and_geo_follows_travelling_sessions_to_their_cache():
    requests = trace_requests(conversations())
    split = split_by_region(requests, REGIONS, (0.6, 0.25, 0.15), 0.5, seed=0)
    assert any(fr.ingress != fr.home for fr in split)
    runs = {policy: FederationSim(split, settings(), policy).run() for policy in ("local", "blind", "geo")}
    local = runs["local"].ledger
    assert local.served_in == local.entered_at
    hits = {}
    for policy, sim in runs.items():
        prompt = sum(fr.request.input_tokens for fr in split)
        hits[policy] = sum(sim.outcomes.cached) / prompt
        assert sim.outcomes.status == ["done"] * len(split)
    assert hits["geo"] > hits["blind"]
    assert hits["geo"] > hits["local"]
    geo = runs["geo"].ledger
    assert any(geo.served_in[i] != geo.entered_at[i] for i in range(len(split)))


def test_a_killed_region_serves_nothing_after_the_kill_and_its_clients_are_served_elsewhere():
    requests = trace_requests(conversations())
    split = split_by_region(requests, REGIONS, (0.2, 0.6, 0.2), 0.0, seed=0)
    sim = FederationSim(split, settings(kill="eu", kill_at_s=6.0), "geo").run()
    late = [i for i, fr in enumerate(split) if fr.request.arrival_s >= 6.0]
    assert late and any(split[i].ingress == "eu" for i in late)
    assert all(sim.ledger.served_in[i] != "eu" for i in late)
    assert all(sim.outcomes.status[i] == "done" for i in late)
    assert "failed" in sim.outcomes.status or not sim.lost_in_flight
