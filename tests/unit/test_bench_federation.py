"""The live half's pure parts: the recovery time over hurt requests, and the cross-region
share read from the ingresses' ``/metrics``."""

from __future__ import annotations

from switchyard.bench.federation import RECOVERY_WINDOW, cross_share, recovery_s, routes_from_metrics

METRICS = """# HELP switchyard_region_routes_total Requests this ingress routed
# TYPE switchyard_region_routes_total counter
switchyard_region_routes_total{reason="home",region="us"} 30.0
switchyard_region_routes_total{reason="spill",region="ap"} 10.0
switchyard_region_routes_created{reason="home",region="us"} 1.7e+09
"""


def _arrivals(n: int) -> list[float]:
    return [100.0 + i for i in range(n)]


def test_no_bad_window_is_recovered_at_once() -> None:
    assert recovery_s([False] * 50, _arrivals(50), 100.0) == 0.0


def test_recovery_ends_with_the_last_bad_window() -> None:
    # requests 0..9 hurt: the last bad window is the last that holds more than 10% of its 20 hurt
    hurt = [i < 10 for i in range(60)]
    bad = int(0.1 * RECOVERY_WINDOW)
    last_bad = max(
        end for end in range(RECOVERY_WINDOW - 1, 60) if sum(hurt[end - RECOVERY_WINDOW + 1 : end + 1]) > bad
    )
    assert recovery_s(hurt, _arrivals(60), 100.0) == _arrivals(60)[last_bad] - 100.0


def test_a_last_window_still_bad_never_recovers() -> None:
    assert recovery_s([True] * 40, _arrivals(40), 100.0) is None
    assert recovery_s([False] * (RECOVERY_WINDOW - 1), _arrivals(RECOVERY_WINDOW - 1), 100.0) is None  # too few


def test_the_cross_share_counts_routes_to_other_regions() -> None:
    routes = routes_from_metrics(METRICS)
    assert routes == {("us", "home"): 30.0, ("ap", "spill"): 10.0}
    assert cross_share({"us": routes, "ap": {("ap", "home"): 10.0}}) == 10 / 50
    assert cross_share({}) is None
