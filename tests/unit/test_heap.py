"""``scheduler.heap``: the startup heap frozen out of the collector, once a process.

Each case runs in a child interpreter: freezing is for the whole process, and this one
runs the rest of the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_freezing_collects_first_then_leaves_later_passes_only_what_came_after():
    out = _run(
        """
        import gc
        import weakref
        from switchyard.scheduler.heap import freeze_heap

        class Node:
            pass

        garbage = Node()
        garbage.me = garbage  # a cycle nobody holds: collected first, not frozen for good
        gone = weakref.ref(garbage)
        del garbage
        kept = [Node() for _ in range(5000)]
        before = len(gc.get_objects())
        frozen = freeze_heap()
        assert gone() is None
        assert frozen >= 5000, frozen
        later = [Node() for _ in range(10)]
        print(before, frozen, len(gc.get_objects()))
        """
    )
    before, frozen, after = map(int, out.split())
    assert after < 100 < before  # a full pass now walks what was made since, not the startup heap
    assert frozen > before // 2


def test_a_second_call_freezes_nothing_more():
    out = _run(
        """
        import gc
        from switchyard.scheduler.heap import freeze_heap

        first = freeze_heap()
        made = [[i] for i in range(1000)]  # tracked objects made after the first freeze
        second = freeze_heap()
        print(first, second, len(gc.get_objects()) >= 1000)
        """
    )
    first, second, unfrozen = out.split()
    assert first == second and unfrozen == "True"
