"""``switchyard up``'s supervision: crashes count within a window, so crashes spread over days
never stop the stack, while a crash loop still does."""

from __future__ import annotations

import sys

from switchyard import procs
from switchyard.up import _Child, supervise_once


def _crashing_child() -> _Child:
    return _Child("decode-0", [sys.executable, "-c", "raise SystemExit(3)"], procs.child_env())


def _crash_at(children: list[_Child], now: float, max_restarts: int = 2, window_s: float = 60.0) -> int | None:
    """Let the child die, then one supervision pass at ``now``; restart it when due."""
    children[0].process.wait(timeout=30)
    result = supervise_once(children, max_restarts, window_s, now)
    if result is None:
        supervise_once(children, max_restarts, window_s, children[0].restart_at or now)  # the restart
    return result


def test_crashes_spread_over_time_never_stop_the_stack() -> None:
    children = [_crashing_child()]
    for day in range(5):  # one crash a day, for five days, with max_restarts 2
        assert _crash_at(children, now=day * 86_400.0) is None
    assert len(children[0].crashes) == 1  # only today's crash is remembered


def test_a_crash_loop_within_the_window_stops_the_stack() -> None:
    children = [_crashing_child()]
    assert _crash_at(children, now=0.0) is None
    assert _crash_at(children, now=5.0) is None
    assert _crash_at(children, now=10.0) == 1  # the third within 60 s, past max_restarts 2
