"""The one percentile definition every benchmark reports with.

``percentile(values, q)`` interpolates linearly between the two closest ranks: sorted
``x[0] <= ... <= x[n-1]``, rank ``h = (n - 1) * q / 100``, result
``x[floor(h)] + (x[floor(h) + 1] - x[floor(h)]) * (h - floor(h))``. That is numpy's default
(``method="linear"``), Hyndman and Fan's type 7, and what spreadsheets' ``PERCENTILE.INC``
give; its p50 is ``statistics.median``.

Why this one and not the nearest rank: any figure here can be checked with
``numpy.percentile`` on the same samples; it is continuous in the samples, so two runs that
differ by one sample differ a little, not by the gap between two neighbours; and on small
samples it does not collapse to the extremes (the nearest rank of p99 over 40 samples is the
maximum itself). Every benchmark in ``bench/`` imports it from here, so a p90 from
``bench sim`` and one from ``bench overhead`` mean the same thing (a unit test checks that no
other definition creeps back in).
"""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values``, interpolated; None when there are none."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


__all__ = ["percentile"]
