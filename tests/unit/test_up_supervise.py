"""``switchyard up``'s supervision: crashes count within a window, so crashes spread over days
never stop the stack, while a crash loop still does."""

from __future__ import annotations

import os
import sys
import time

import pytest

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


def _child_with_grandchild(tmp_path) -> tuple[_Child, int]:
    """A child that starts a long-lived process of its own (as a vLLM worker starts its engine
    core) and is then SIGKILLed: the grandchild outlives it, in its process group."""
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import pathlib, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(g.pid))\n"
        "time.sleep(600)\n"
    )
    child = _Child("decode-0", [sys.executable, "-c", code], procs.child_env())
    deadline = time.monotonic() + 30
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the child never started its grandchild"
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    child.process.kill()
    child.process.wait(timeout=30)
    assert _alive(grandchild), "the grandchild died with its parent: nothing left to show"
    return child, grandchild


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # an exited one not yet reaped by init reads Z
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while _alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(sys.platform != "linux", reason="process groups as spawn sets them up: Linux")
def test_a_dead_childs_own_children_go_before_it_is_restarted(tmp_path) -> None:
    """A worker killed outright leaves its engine core running (holding the GPU's memory, so
    the restarted worker could not allocate its own): supervision kills the rest of its
    process group before the restart."""
    child, grandchild = _child_with_grandchild(tmp_path)
    try:
        assert supervise_once([child], 2, 60.0, 0.0) is None  # a restart scheduled
        assert _gone(grandchild)
    finally:
        procs.stop([child.process])


@pytest.mark.skipif(sys.platform != "linux", reason="process groups as spawn sets them up: Linux")
def test_stopping_a_child_stops_what_it_left_behind(tmp_path) -> None:
    child, grandchild = _child_with_grandchild(tmp_path)
    procs.stop([child.process])
    assert _gone(grandchild)
