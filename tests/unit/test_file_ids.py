"""File ids sort in creation order: by millisecond, and within one (or a clock stepping back)
one after the other."""

from __future__ import annotations

import re

from switchyard.ingress.files import FileIds


def test_ids_sort_in_creation_order_whatever_the_clock_does():
    times = iter([1.0, 1.0, 1.0, 0.5, 2.0, 2.0005, 2.001])
    ids = FileIds(clock=lambda: next(times))
    made = [ids.next() for _ in range(7)]
    assert all(re.fullmatch(r"file-[0-9a-f]{24}", i) for i in made)
    assert made == sorted(made) and len(set(made)) == 7
    assert made[4][5:17] == f"{2000:012x}" and made[6][5:17] == f"{2001:012x}"  # the millisecond leads
