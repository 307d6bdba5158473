"""`switchyard bench chaos` at a tiny size: a reference run and one run whose workers are
SIGKILLed under load, each through its own ``switchyard up``. No speed and no share of
completions is asserted (at this size two kills can take both decode workers at once):
only that the report is whole, that every request is accounted for, and that whatever
completed under the kills is exactly what the undisturbed run streamed."""

from __future__ import annotations

import json
import subprocess

from switchyard import procs
from switchyard.bench.chaos import OUTCOMES, Kill, Outcome, Watch, classify, kill_plan, make_requests, recovery


def test_kill_plan_spaces_the_scheduler_and_nats_between_worker_kills() -> None:
    plan = kill_plan(("workers", "scheduler", "nats"), 10.0, reference_s=90.0, horizon_s=60.0)
    assert [t for t, kind in plan if kind == "worker"] == [10.0, 20.0, 30.0, 40.0, 50.0, 60.0]
    assert ("scheduler", 35.0) in [(kind, t) for t, kind in plan]  # a third of 90 s, between two kills
    assert ("nats", 65.0) in [(kind, t) for t, kind in plan]
    assert kill_plan(("nats",), 10.0, reference_s=90.0, horizon_s=60.0) == [(65.0, "nats")]


def test_requests_are_seeded_and_within_their_ranges() -> None:
    a, b = make_requests(50, 7, (50, 400), (64, 256)), make_requests(50, 7, (50, 400), (64, 256))
    assert a == b and a != make_requests(50, 8, (50, 400), (64, 256))
    assert all(50 <= len(r.prompt) <= 400 and 64 <= r.max_tokens <= 256 for r in a)


def test_a_completion_counts_as_identical_only_when_text_tokens_and_ending_match() -> None:
    reference = Outcome("completed", "a b c", 3, "length")
    assert classify(reference, Outcome("completed", "a b c", 3, "length")) == "identical"
    assert classify(reference, Outcome("completed", "a b d", 3, "length")) == "different"
    assert classify(reference, Outcome("completed", "a b c", 4, "length")) == "different"
    assert classify(reference, Outcome("clean_error", "a b", error="worker_lost")) == "clean_error"
    assert classify(reference, Outcome("hang")) == "hang"


def test_recovery_counts_from_the_kill_to_a_served_probe_and_to_the_fleet_whole_after_the_restart() -> None:
    kill = Kill("worker", 10.0, "decode-0", restarted_s=2.0)
    probes = [(9.9, 10.1, True), (10.2, 10.5, False), (10.3, 10.6, True)]  # the first was sent before the kill
    health = [(10.0, True), (10.5, False), (11.0, True), (12.5, True)]  # whole at 11.0 still counted the dead one
    recovery(kill, Watch(probes, health))
    assert kill.served_s is not None and abs(kill.served_s - 0.6) < 1e-9
    assert kill.fleet_s is not None and abs(kill.fleet_s - 2.5) < 1e-9
    seamless = Kill("worker", 10.0, "decode-1", restarted_s=1.2)  # back before the scheduler noticed
    recovery(seamless, Watch([], [(10.0, True), (12.0, True), (20.5, False), (22.0, True)]), until_s=20.0)
    assert seamless.fleet_s is None and "no health dip" in seamless.note  # the next kill's dip is not its


def test_bench_chaos_compares_every_request_with_the_undisturbed_run(tmp_path) -> None:
    out = tmp_path / "chaos"
    command = procs.service_command(
        "bench",
        "chaos",
        "--requests",
        "40",
        "--concurrency",
        "16",
        "--max-tokens",
        "16,48",
        "--kill",
        "workers",
        "--kill-every-s",
        "1.5",
        "--out",
        str(out),
    )
    run = subprocess.run(command, capture_output=True, text=True, timeout=150, env=procs.child_env())
    assert run.returncode == 0, run.stdout + run.stderr
    assert "| reference |" in run.stdout and "| workers |" in run.stdout
    results = json.loads((out / "results.json").read_text())
    reference, chaos = results["runs"]
    assert reference["run"] == "reference" and reference["identical"] == 40 and not reference["kills"]
    assert chaos["run"] == "workers" and chaos["killed"] == ["workers"]
    assert chaos["compared"] == 40 and sum(chaos[k] for k in OUTCOMES) == 40
    assert chaos["kills"] and all(k["kind"] == "worker" for k in chaos["kills"])
    assert all(k["target"].startswith(("prefill-", "decode-")) for k in chaos["kills"])
    assert chaos["restarts"] >= 1
    assert chaos["stranded"]["read"]
    assert set(chaos["goals"]) >= {"complete_or_clean_error", "no_differences", "nothing_stranded"}
    assert chaos["different"] == 0, chaos["differences"]  # what completed is what the reference streamed
    for figure in ("outcomes.png", "timeline-workers.png"):
        assert (out / figure).stat().st_size > 0
