"""``switchyard bench sim --sweep``: every policy at every load, and where each one saturates.

    switchyard bench sim --trace mooncake.jsonl --policies dynamo_kv,switchyard \\
        --prefill 6 --decode 2 --limit 4000 --sweep 2,1.5,1,0.75,0.5,0.35,0.25 --out bench/results/sweep

Each ``--sweep`` value is a ``--time-scale``: the same requests, their arrival times
multiplied by it (below 1: more load). The offered load of a point is the trace's requests
over its span at that scale. Two saturation figures per policy, both read off the sweep
(so they are only as fine as its points):

- **peak**: the offered load at which its goodput (requests/s meeting both SLOs) is highest.
  Past it, more load brings less goodput. When the peak is the sweep's heaviest point the
  policy has not saturated within the sweep (``saturated`` is false): the true peak is higher.
- **SLO knee**: the highest offered load up to which ``goodput_fraction`` stays at least 90 %
  of its value at the sweep's lightest load (every point from the lightest up to it does):
  how far load can grow before one request in ten more misses its SLOs.

Runs are independent and deterministic, so ``--jobs`` processes may run them in any order:
``sweep.json`` is written in policy then load order and is the same byte for byte.
Writes ``sweep.json``, ``goodput_vs_load.png`` and ``ttft_p90_vs_load.png`` into ``--out``,
and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from switchyard.bench import plots
from switchyard.bench.replay import ReplaySettings, replay
from switchyard.bench.traces import TraceRequest, hit_ratio_bound

KNEE_SHARE = 0.9  # the SLO knee: goodput_fraction at least this share of its light-load value
POINT_KEYS = (
    "goodput_rps",
    "goodput_fraction",
    "ttft_p50_s",
    "ttft_p90_s",
    "tpot_p90_s",
    "cache_hit_ratio",
    "completed",  # counts of requests; completed_fraction too
    "rejected",
    "failed",  # streams the core failed (FailStream; one shedding load fails them "overloaded")
    "unfinished",
)


def run(args: argparse.Namespace, policies: list[str], requests: list[TraceRequest]) -> int:
    from switchyard.bench.sim import _fleet_record, settings_of

    runs = [settings_of(args, policy, scale) for policy in policies for scale in args.sweep]
    print(
        f"{args.trace.name}: {len(requests)} requests; sweep of {len(runs)} runs "
        f"({len(policies)} policies x time scales {', '.join(f'{s:g}' for s in args.sweep)}) "
        f"in {min(args.jobs, len(runs))} process(es)",
        flush=True,
    )
    fleet = {k: v for k, v in _fleet_record(runs[0]).items() if k != "time_scale"}
    kept = kept_policies(args.out / "sweep.json", args, fleet, requests) if getattr(args, "merge", False) else {}
    points = run_points(requests, runs, args.jobs)
    record = {"trace": args.trace.name, "fleet": fleet} | sweep_record(requests, policies, args.sweep, points)
    record["policies"] = kept | record["policies"]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sweep.json").write_text(json.dumps(record, indent=2) + "\n")
    print(table(record), flush=True)
    plot(record, args.out)
    print(f"\nwrote {args.out / 'sweep.json'}, {args.out / 'goodput_vs_load.png'}, {args.out / 'ttft_p90_vs_load.png'}")
    return 0


# --- the runs ----------------------------------------------------------------------------------------

_requests: list[TraceRequest] = []  # a pool process's copy of the trace, sent once


def _init(requests: list[TraceRequest]) -> None:
    global _requests
    _requests = requests


def point(settings: ReplaySettings, requests: list[TraceRequest] | None = None) -> dict:
    """One run's figures at one load (in a pool process, on the trace it was sent)."""
    from switchyard.bench.sim import summarize

    requests = _requests if requests is None else requests
    started = time.perf_counter()
    result = replay(requests, settings)
    summary = summarize(result, hit_ratio_bound(requests), "", settings.ttft_slo_s, settings.tpot_slo_s)
    return {
        "policy": settings.policy,
        "time_scale": settings.time_scale,
        "offered_rps": len(requests) / summary["trace_span_s"],
        **{key: summary[key] for key in POINT_KEYS},
        "completed_fraction": summary["completed"] / len(requests) if requests else 0.0,
        "wall_s": time.perf_counter() - started,  # dropped from sweep.json: it varies
    }


def run_points(requests: list[TraceRequest], runs: list[ReplaySettings], jobs: int) -> list[dict]:
    """Every run's point, in the order of ``runs``; progress printed as each ends."""
    done: list[dict | None] = [None] * len(runs)

    def report(i: int, p: dict) -> None:
        done[i] = p
        finished = sum(1 for d in done if d is not None)
        print(
            f"  [{finished}/{len(runs)}] {p['policy']} at time scale {p['time_scale']:g} "
            f"({p['offered_rps']:.2f} req/s offered): goodput {p['goodput_rps']:.2f} req/s, "
            f"{p['goodput_fraction']:.1%} of requests, {p['rejected']} rejected ({p['wall_s']:.1f} s wall)",
            flush=True,
        )

    if jobs <= 1 or len(runs) == 1:
        for i, settings in enumerate(runs):
            report(i, point(settings, requests))
    else:
        # spawn, not fork: a fresh interpreter per process, whatever threads this one holds
        context = get_context("spawn")
        with ProcessPoolExecutor(min(jobs, len(runs)), context, _init, (requests,)) as pool:
            futures = {pool.submit(point, settings): i for i, settings in enumerate(runs)}
            for future in as_completed(futures):
                report(futures[future], future.result())
    assert all(d is not None for d in done)
    return [d for d in done if d is not None]


# --- the figures -------------------------------------------------------------------------------------


def sweep_record(requests: list[TraceRequest], policies: list[str], scales: list[float], points: list[dict]) -> dict:
    """What ``sweep.json`` holds: per policy, its points by offered load and its saturation."""
    per_policy: dict[str, dict] = {}
    for policy in policies:
        mine = sorted((p for p in points if p["policy"] == policy), key=lambda p: p["offered_rps"])
        kept = [{k: v for k, v in p.items() if k not in ("policy", "wall_s")} for p in mine]
        per_policy[policy] = {"points": kept, "saturation": saturation(kept)}
    return {"requests": len(requests), "time_scales": scales, "knee_share": KNEE_SHARE, "policies": per_policy}


def kept_policies(path: Path, args: argparse.Namespace, fleet: dict, requests: list[TraceRequest]) -> dict:
    """``--merge``: the policies of the sweep already at ``path``, kept beside the ones run
    now (one policy run again after a change to it). Only a sweep of the very same trace,
    fleet, requests and time scales merges: anything else is an error, before any run,
    that says what differs."""
    if not path.exists():
        return {}
    old = json.loads(path.read_text())
    now = {"trace": args.trace.name, "fleet": fleet, "requests": len(requests), "time_scales": args.sweep}
    now["knee_share"] = KNEE_SHARE
    differ = [key for key, value in now.items() if old.get(key) != value]
    if differ:
        raise SystemExit(f"--merge: {path} is a sweep of another {', '.join(differ)}; run every policy instead")
    policies: dict = old["policies"]
    return policies


def saturation(points: list[dict]) -> dict:
    """The peak and the SLO knee of one policy's points (sorted by offered load); see the notes."""
    peak = max(points, key=lambda p: (p["goodput_rps"], -p["offered_rps"]))  # a tie: the lighter load
    floor = KNEE_SHARE * points[0]["goodput_fraction"]
    knee = points[0]
    for p in points:
        if p["goodput_fraction"] < floor:
            break
        knee = p
    return {
        "peak_offered_rps": peak["offered_rps"],
        "peak_goodput_rps": peak["goodput_rps"],
        "saturated": peak is not points[-1],
        "knee_offered_rps": knee["offered_rps"],
        "knee_goodput_fraction": knee["goodput_fraction"],
        "light_goodput_fraction": points[0]["goodput_fraction"],
    }


def table(record: dict) -> str:
    def ms(x: float | None) -> str:
        return f"{x * 1e3:>9.0f}" if x is not None else f"{'-':>9}"

    head = (
        f"{'policy':<20}{'scale':>6}{'offered':>9}{'goodput':>9}{'good%':>7}{'TTFT p50':>9}{'p90':>9}"
        f"{'TPOT p90':>9}{'hit':>7}{'rej':>6}{'fail':>6}"
    )
    lines = ["", "loads and goodput in requests/s; times in ms; good% of all requests (rejected ones miss)", head]
    for policy, entry in record["policies"].items():
        for p in entry["points"]:
            lines.append(
                f"{policy:<20}{p['time_scale']:>6g}{p['offered_rps']:>9.2f}{p['goodput_rps']:>9.2f}"
                f"{p['goodput_fraction']:>7.1%}{ms(p['ttft_p50_s'])}{ms(p['ttft_p90_s'])}{ms(p['tpot_p90_s'])}"
                f"{p['cache_hit_ratio']:>7.3f}{p['rejected']:>6}{p['failed']:>6}"
            )
    lines += ["", f"saturation: peak = load of the highest goodput; knee = last load with good% >= {KNEE_SHARE:.0%}"]
    lines.append("of the lightest load's")
    lines.append(f"{'policy':<20}{'peak load':>10}{'goodput':>9}{'knee load':>10}{'good%':>7}")
    for policy, entry in record["policies"].items():
        s = entry["saturation"]
        edge = "" if s["saturated"] else "  (peak at the heaviest load: not saturated within the sweep)"
        lines.append(
            f"{policy:<20}{s['peak_offered_rps']:>10.2f}{s['peak_goodput_rps']:>9.2f}"
            f"{s['knee_offered_rps']:>10.2f}{s['knee_goodput_fraction']:>7.1%}{edge}"
        )
    return "\n".join(lines)


def plot(record: dict, out: Path) -> None:
    for key, name, ylabel in (
        ("goodput_rps", "goodput_vs_load.png", "goodput, requests/s meeting both SLOs"),
        ("ttft_p90_s", "ttft_p90_vs_load.png", "TTFT p90, seconds"),
    ):
        fig, ax = plots.figure()
        for policy, entry in record["policies"].items():
            xs = [p["offered_rps"] for p in entry["points"] if p[key] is not None]
            ax.plot(xs, [p[key] for p in entry["points"] if p[key] is not None], "o-", label=policy)
        if key == "goodput_rps":
            loads = [p["offered_rps"] for e in record["policies"].values() for p in e["points"]]
            ax.plot([0, max(loads)], [0, max(loads)], "k:", label="offered")
        plots.save(
            fig,
            ax,
            out / name,
            title=f"{ylabel.split(',')[0]} vs offered load (simulated fleet)",
            xlabel="offered load, requests/s",
            ylabel=ylabel,
            log_y=key == "ttft_p90_s",
        )


__all__ = ["KNEE_SHARE", "point", "run", "run_points", "saturation", "sweep_record", "table"]
