"""bench.bound: the decode side's goodput bound, against hand arithmetic and a brute force."""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import pytest

from switchyard.bench import bound
from switchyard.bench.costmodel import CostModel
from switchyard.bench.traces import TraceRequest, blocks_for

COST = CostModel()


def _requests(outputs: list[int], prompt: int = 8000) -> list[TraceRequest]:
    return [
        TraceRequest(
            arrival_s=float(i), input_tokens=prompt, output_tokens=n, block_ids=tuple(range(blocks_for(prompt)))
        )
        for i, n in enumerate(outputs)
    ]


def _by(found: list[bound.Bound], model: str, join: float) -> bound.Bound:
    return next(b for b in found if b.model == model and b.join_steps == join)


def test_long_answers_alone_step_as_slowly_as_their_slo_allows() -> None:
    # 100 steps each: an answer keeps a 50 ms SLO with a 10 ms report while 100 * (0.05 - S) >= 0.01,
    # so up to S = 49.9 ms; the slowest step serves the most sequences a second.
    answers = bound.Answers(_requests([101] * 50), COST)
    assert answers.context == pytest.approx(8000 + 101 / 2)
    per_seq = COST.decode_per_seq_s + COST.decode_per_kv_token_s * answers.context
    found = bound.bounds(answers, workers=2, slo_s=0.05, report_s=0.01)
    one = _by(found, "one step time", 0.0)
    assert one.step_s == pytest.approx(0.0499, abs=1e-6)
    sequences = (0.0499 - COST.decode_base_s) / per_seq
    assert one.sequences == pytest.approx(sequences, rel=1e-6)
    assert one.goodput_rps == pytest.approx(2 * sequences / 0.0499 / 100, rel=1e-6)
    assert one.good_share == 1.0
    # With half a step to join: 100 * (0.05 - S) >= 0.01 + S / 2, S <= 49.65 ms: on the 0.1 ms grid, 49.6.
    assert _by(found, "one step time", 0.5).step_s == pytest.approx(0.0496, abs=1e-6)
    # Nothing to split: two step times give the same.
    assert _by(found, "two step times", 0.0).goodput_rps == pytest.approx(one.goodput_rps)


def test_two_token_answers_cannot_keep_the_slo_on_slow_steps() -> None:
    # One step: 0.05 - S >= 0.01 keeps it, S <= 40 ms. Half the answers are 2 tokens, half 101.
    answers = bound.Answers(_requests([2] * 50 + [101] * 50), COST)
    one = _by(bound.bounds(answers, workers=2, slo_s=0.05, report_s=0.01), "one step time", 0.0)
    if one.step_s <= 0.04 + 1e-9:
        assert one.good_share == 1.0
    else:
        assert one.good_share == 0.5
    # Serving every answer at 40 ms against losing the short ones at 49.9 ms: the better of the two.
    mean_steps = (50 * 1 + 50 * 100) / 100
    per_seq = COST.decode_per_seq_s + COST.decode_per_kv_token_s * answers.context

    def rate(step_s: float) -> float:
        return (step_s - COST.decode_base_s) / per_seq / step_s

    keep_all = 2 * rate(0.04) / mean_steps
    lose_short = 0.5 * 2 * rate(0.0499) / mean_steps
    assert one.goodput_rps == pytest.approx(max(keep_all, lose_short), rel=1e-3)


def test_one_token_answers_take_no_step_and_always_count() -> None:
    answers = bound.Answers(_requests([1] * 10 + [101] * 10), COST)
    one = _by(bound.bounds(answers, workers=1, slo_s=0.05, report_s=0.01), "one step time", 0.0)
    assert one.good_share == 1.0
    assert answers.mean_steps == 50.0


def _brute(answers: bound.Answers, outputs: list[int], workers: int, slo: float, report: float, join: float):
    """Every (k, S1, S2) of the grid, every answer placed by hand: where it keeps the SLO on
    the slow workers, there; else where it keeps it on the quick ones; else anywhere."""
    grid = [
        answers.base_s + bound._STEP_GRID_S * i for i in range(1, 1000) if answers.base_s + bound._STEP_GRID_S * i < slo
    ]
    rate = {s: (s - answers.base_s) / answers.per_seq_s / s for s in grid}
    keeps = lambda n, s: n <= 1 or (n - 1) * (slo - s) >= report + join * s - 1e-12  # noqa: E731
    best_one = max(
        workers * rate[s] / answers.mean_steps * sum(keeps(n, s) for n in outputs) / len(outputs) for s in grid
    )
    best_two = best_one
    for k in range(1, workers):
        for i, s1 in enumerate(grid):
            for s2 in grid[i:]:
                quick = sum(n - 1 for n in outputs if not keeps(n, s2) and keeps(n, s1)) / len(outputs)
                good = sum(keeps(n, s2) or keeps(n, s1) for n in outputs) / len(outputs)
                served = (k * rate[s1] + (workers - k) * rate[s2]) / answers.mean_steps
                if quick > 0:
                    served = min(served, k * rate[s1] / quick)
                best_two = max(best_two, served * good)
    return best_one, best_two


@pytest.mark.parametrize("workers", [1, 3])
def test_the_bounds_are_the_brute_force_over_the_same_grid(monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    monkeypatch.setattr(bound, "_STEP_GRID_S", 0.001)  # 31 step times: the brute force stays quick
    rng = random.Random(7)
    outputs = [rng.choice([1, 2, 3, 4, 6, 9, 15, 40, 120, 300]) for _ in range(120)]
    answers = bound.Answers(_requests(outputs), COST)
    found = bound.bounds(answers, workers=workers, slo_s=0.05, report_s=0.01)
    for join in bound._JOINS:
        one, two = _brute(answers, outputs, workers, 0.05, 0.01, join)
        assert _by(found, "one step time", join).goodput_rps == pytest.approx(one, rel=1e-9)
        assert _by(found, "two step times", join).goodput_rps == pytest.approx(two, rel=1e-9)
        if workers == 1:
            assert two == one
    # The split pays on this mix: short answers on a quick worker, long ones on slow steps.
    if workers == 3:
        assert _by(found, "two step times", 0.0).goodput_rps > _by(found, "one step time", 0.0).goodput_rps
        assert _by(found, "two step times", 0.0).quick_workers >= 1


def test_no_step_within_the_slo_is_an_error_that_says_why() -> None:
    answers = bound.Answers(_requests([10]), COST)
    with pytest.raises(ValueError, match="no step keeps"):
        bound.bounds(answers, workers=2, slo_s=0.01, report_s=0.01)
    with pytest.raises(ValueError, match="no requests"):
        bound.Answers([], COST)


def test_the_command_prints_the_table_and_writes_json_and_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 100 * i, "input_length": 4000, "output_length": n, "hash_ids": list(range(8))}
        for i, n in enumerate([2, 30, 200] * 20)
    ]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = argparse.Namespace(
        trace=trace, format=None, decode=2, tpot_slo_s=0.05, report_delay_s=0.01, peer_goodput=3.0, out=tmp_path / "out"
    )
    assert bound.run(args) == 0
    printed = capsys.readouterr().out
    assert "two step times" in printed and "ratio" in printed
    record = json.loads((tmp_path / "out" / "bound.json").read_text())
    assert record["requests"] == 60 and record["decode_workers"] == 2
    assert len(record["bounds"]) == 4
    assert all(b["goodput_rps"] > 0 for b in record["bounds"])
    assert (tmp_path / "out" / "bound.png").stat().st_size > 1000
    args.tpot_slo_s = 0.0
    with pytest.raises(SystemExit, match="tpot-slo-s"):
        bound.run(args)
    args.tpot_slo_s, args.peer_goodput = 0.05, -3.0
    with pytest.raises(SystemExit, match="peer-goodput"):
        bound.run(args)
