"""``bench.stats.percentile``: the one percentile definition, and that every benchmark uses it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from switchyard.bench import overhead, stats
from switchyard.bench.stats import percentile

BENCH = Path(stats.__file__).parent


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),  # between the two middle ranks, like statistics.median
        ([1.0, 2.0, 3.0, 4.0], 90, 3.7),  # rank 2.7: 3 + 0.7 * (4 - 3)
        ([1.0, 2.0, 3.0, 4.0], 0, 1.0),
        ([1.0, 2.0, 3.0, 4.0], 100, 4.0),
        ([4.0, 1.0, 3.0, 2.0], 25, 1.75),  # order of the input does not matter
        ([10.0, 20.0], 99, 19.9),  # nearest rank would say 20
        ([5.0], 99, 5.0),
        (range(1, 11), 90, 9.1),  # numpy.percentile(range(1, 11), 90)
        (range(1, 41), 99, 39.61),  # nearest rank would give the maximum, 40
    ],
)
def test_percentile_interpolates_between_closest_ranks_like_numpy(values, q, expected):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_of_nothing_is_none_and_q_is_checked():
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match=r"0\.\.100"):
        percentile([1.0], 101)


def test_overhead_reports_the_shared_percentiles():
    samples = [0.001 * x for x in (1, 2, 3, 4, 10)]
    figures = overhead.ttft_figures({"fabric": samples, "engine_alone": samples[:4], "nats_rr": samples})
    assert figures["fabric_p50"] == pytest.approx(3.0)
    assert figures["fabric_p99"] == pytest.approx(1e3 * percentile(samples, 99))  # 9.76, not 10
    assert figures["engine_alone_p50"] == pytest.approx(2.5)  # nearest rank: 2 or 3
    assert figures["added_p50"] == pytest.approx(0.5)


def _percentile_code(path: Path) -> list[str]:
    """Places in ``path`` that compute an order statistic themselves instead of calling stats."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef) and any(w in node.name.lower() for w in ("pct", "percentile", "quantile")):
            found.append(f"{path.name}:{node.lineno} def {node.name}")
        if isinstance(node, ast.Attribute) and node.attr in ("median", "quantiles", "percentile", "quantile"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "stats"):
                found.append(f"{path.name}:{node.lineno} .{node.attr}")
        if isinstance(node, ast.ImportFrom) and node.module in ("statistics", "numpy"):
            found.append(f"{path.name}:{node.lineno} from {node.module} import ...")
    return found


def test_no_benchmark_has_a_percentile_of_its_own():
    others = [hit for path in sorted(BENCH.glob("*.py")) if path.name != "stats.py" for hit in _percentile_code(path)]
    assert others == []
