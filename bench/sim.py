"""``switchyard bench sim``: replay a real trace through the real scheduler core, in
virtual time, over a simulated fleet; one run per placement policy.

    switchyard bench sim --trace mooncake.jsonl --policies round_robin,switchyard \\
        --prefill 4 --decode 2 --out bench/results/sim

Each policy gets a fresh ``SchedulerCore`` and a fresh fleet (``bench.fleet``) whose
times come from a cost model calibrated to NVIDIA's published H100 latencies for
Llama-3.3-70B (``bench.costmodel``: the citation and the numbers). ``--colocated``
runs the same number of GPUs as ``both`` workers, without disaggregation.

Writes into ``--out``:
- ``results.json``: one object per policy (hit ratio and its infinite-cache bound,
  TTFT/TPOT percentiles, goodput, rejections, the index's bytes per block, ...).
  Virtual-time results only: the same trace, flags and seed give the same file.
- ``timing.json``: wall-clock figures (run time, the core's decisions per second),
  which vary from run to run and so are kept apart.
- ``tables.md``: the tables ``docs/bench-sim.md`` shows for a run, made from those two files
  (``bench.simdoc``, which also rewrites the doc's tables).
- ``ttft_cdf.png``, ``tpot_cdf.png``: the distributions per policy.
and prints a table. ``--sweep 2,1,0.5`` instead runs every policy at each of those time
scales and writes ``sweep.json`` and load curves (``bench.sweep``).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from switchyard.bench import plots, simdoc
from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import FleetShape
from switchyard.bench.replay import ReplayResult, ReplaySettings, replay
from switchyard.bench.stats import percentile
from switchyard.bench.traces import TraceRequest, hit_ratio_bound, lru_hit_ratio, read_trace
from switchyard.scheduler import SchedulerConfig

DEFAULT_POLICIES = "round_robin,least_requests,least_tokens,sglang_cache_aware,dynamo_kv,llmd,llmd_precise,switchyard"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL or Azure CSV trace")
    p.add_argument("--format", choices=["mooncake", "azure"], default=None, help="default: from the file")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated prefill placement policies")
    p.add_argument("--prefill", type=positive_int, default=4, help="prefill workers (model instances)")
    p.add_argument("--decode", type=positive_int, default=2, help="decode workers")
    p.add_argument(
        "--colocated", action="store_true", help="prefill+decode workers of role 'both' instead (no disaggregation)"
    )
    p.add_argument(
        "--lendable",
        action="store_true",
        help="disaggregated, but the prefill workers are of role 'both': switchyard may lend them to decoding",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/sim"), help="results folder")
    p.add_argument("--limit", type=positive_int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times (below 1: the same trace, faster, more load)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="recorded, and passed to the core if its config has a seed (nothing here draws at random)",
    )
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=CostModel().kv_capacity_tokens // 512,
        help="prefix cache per worker, in 512-token blocks (default: its HBM KV capacity)",
    )
    p.add_argument(
        "--host-cache-blocks",
        type=non_negative_int,
        default=0,
        help="a host-DRAM tier below each worker's device cache, in blocks (0: none); loads cost PCIe time",
    )
    p.add_argument(
        "--disk-cache-blocks",
        type=non_negative_int,
        default=0,
        help="a local-disk tier below the host tier, in blocks (0: none); loads cost NVMe time",
    )
    p.add_argument(
        "--kv-event-delay-s",
        type=non_negative_float,
        default=0.05,
        help="KV event batches and snapshots reach the core this late (in order per worker)",
    )
    p.add_argument(
        "--report-delay-s",
        type=non_negative_float,
        default=0.01,
        help="PrefillDone and RequestFinished reach the core this late (in order per worker)",
    )
    p.add_argument(
        "--prefill-token-budget",
        type=positive_int,
        default=65_536,
        help="uncached tokens a prefill worker may hold in flight (its LoadReport token_budget)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=positive_int,
        default=CostModel().chunk_tokens,
        help="tokens per engine iteration (vLLM max_num_batched_tokens)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=positive_int,
        default=SchedulerConfig().max_queued_tokens,
        help="the core's admission limit (429 past it)",
    )
    p.add_argument(
        "--local-prefill-max-tokens",
        type=int,
        default=0,
        help="conditional disaggregation: prefill on the decode worker up to this many uncached tokens",
    )
    p.add_argument("--ttft-slo-s", type=float, default=2.0, help="goodput: time to first token at most this")
    p.add_argument("--tpot-slo-s", type=float, default=0.05, help="goodput: time per output token at most this")
    p.add_argument(
        "--sweep",
        type=time_scales,
        default=None,
        metavar="SCALES",
        help="comma-separated --time-scale values: every policy at every scale, sweep.json and load curves",
    )
    p.add_argument("--jobs", type=positive_int, default=2, help="--sweep: runs in this many processes at once")
    p.add_argument(
        "--merge",
        action="store_true",
        help="--sweep: keep the other policies of the sweep.json already in --out (same trace, fleet and scales)",
    )


def positive_int(text: str) -> int:
    """An argparse type: an integer above 0 (the benches' worker counts and limits)."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def time_scales(text: str) -> list[float]:
    """``--sweep``: positive time scales, each once, in the order given."""
    try:
        scales = [float(part) for part in text.split(",") if part.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a list of numbers: {text!r}") from e
    if not scales or any(not scale > 0 for scale in scales):
        raise argparse.ArgumentTypeError(f"time scales must be positive numbers, got {text!r}")
    if len(set(scales)) != len(scales):
        raise argparse.ArgumentTypeError(f"a time scale is repeated in {text!r}")
    return scales


def settings_of(args: argparse.Namespace, policy: str, time_scale: float) -> ReplaySettings:
    """One run's settings, from the command line."""
    shape = FleetShape(
        args.prefill,
        args.decode,
        args.colocated,
        args.cache_blocks,
        args.prefill_token_budget,
        host_cache_blocks=args.host_cache_blocks,
        disk_cache_blocks=args.disk_cache_blocks,
        lendable=args.lendable,
    )
    return ReplaySettings(
        policy=policy,
        shape=shape,
        cost=CostModel(chunk_tokens=args.chunk_tokens),
        max_queued_tokens=args.max_queued_tokens,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
        seed=args.seed,
        time_scale=time_scale,
        kv_event_delay_s=args.kv_event_delay_s,
        report_delay_s=args.report_delay_s,
        ttft_slo_s=args.ttft_slo_s,
        tpot_slo_s=args.tpot_slo_s,
    )


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    if args.time_scale <= 0:
        raise ValueError("--time-scale must be positive")
    loaded = time.perf_counter()
    requests = read_trace(args.trace, args.format, args.limit)
    if args.sweep is not None:
        from switchyard.bench import sweep

        return sweep.run(args, policies, requests)
    bound = hit_ratio_bound(requests)
    mode = "colocated" if args.colocated else "disaggregated"
    shape = settings_of(args, policies[0], args.time_scale).shape
    # What caches of the prefill-capable workers' total size could hold at best: one LRU.
    prefill_capable = args.prefill + args.decode if args.colocated else args.prefill
    per_worker = args.cache_blocks + args.host_cache_blocks + args.disk_cache_blocks  # every tier
    fleet_bound = lru_hit_ratio(requests, prefill_capable * per_worker)
    print(
        f"{args.trace.name}: {len(requests)} requests over {_span(requests, args.time_scale):.0f} s "
        f"(read in {time.perf_counter() - loaded:.1f} s), hit ratio bound {bound:.3f} "
        f"(one LRU of the fleet's {prefill_capable * per_worker} prefill cache blocks: {fleet_bound:.3f}); "
        f"{mode} fleet {_describe(shape)}",
        flush=True,
    )
    results, timings = [], []
    for policy in policies:
        result = replay(requests, settings_of(args, policy, args.time_scale), _progress_printer(policy))
        results.append(
            summarize(result, bound, mode, args.ttft_slo_s, args.tpot_slo_s)
            | {"hit_ratio_bound_fleet_cache": fleet_bound}
        )
        timings.append(timing_of(result))
        print(f"  {policy}: done in {result.wall_s:.1f} s wall, {result.events} events", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    public = [{k: v for k, v in r.items() if not k.endswith("_samples_s")} for r in results]
    (args.out / "results.json").write_text(json.dumps(public, indent=2) + "\n")
    (args.out / "timing.json").write_text(json.dumps(timings, indent=2) + "\n")
    (args.out / "tables.md").write_text(simdoc.tables({"results": public, "timing": timings}))
    print(table(results, timings), flush=True)
    plot_cdfs(results, args.out)
    print(
        f"\nwrote {args.out / 'results.json'}, {args.out / 'timing.json'}, {args.out / 'tables.md'}, "
        f"{args.out / 'ttft_cdf.png'}, {args.out / 'tpot_cdf.png'}"
    )
    return 0


def parse_policies(text: str) -> list[str]:
    """The policy names, checked against the core's registry before anything runs."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError("--policies is empty")
    if "policy" not in SchedulerConfig.__struct_fields__:
        raise ValueError("this scheduler core has no policy setting (SchedulerConfig.policy)")
    from switchyard.scheduler import POLICIES

    unknown = [name for name in names if name not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {', '.join(map(repr, unknown))}; choose from {', '.join(sorted(POLICIES))}")
    return names


# --- figures ------------------------------------------------------------------------------------


def summarize(result: ReplayResult, bound: float, mode: str, ttft_slo_s: float, tpot_slo_s: float) -> dict:
    requests, out = result.requests, result.outcomes
    ttfts, tpots, good = [], [], 0
    prompt = cached = 0
    by_tier = {"device": 0, "host": 0, "disk": 0}
    arrival = [r.arrival_s * result.settings.time_scale for r in requests]
    for i, request in enumerate(requests):
        if out.first_token[i] < 0:
            continue
        prompt += request.input_tokens
        cached += out.cached[i]
        served = out.served[i]
        by_tier["device"] += served.device
        by_tier["host"] += served.host
        by_tier["disk"] += served.disk
        if out.status[i] != "done":
            continue
        ttft = out.first_token[i] - arrival[i]
        ttfts.append(ttft)
        tpot = None
        if request.output_tokens > 1:
            tpot = (out.last_token[i] - out.first_token[i]) / (request.output_tokens - 1)
            tpots.append(tpot)
        if ttft <= ttft_slo_s and (tpot is None or tpot <= tpot_slo_s):
            good += 1
    span = max(arrival) - min(arrival) or 1.0
    summary = {
        "policy": result.settings.policy,
        "mode": mode,
        "requests": len(requests),
        "completed": out.status.count("done"),
        "rejected": out.status.count("rejected"),
        "failed": out.status.count("failed"),
        "unfinished": out.status.count("pending"),
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "hit_ratio_bound": bound,
        # prompt tokens served from each tier / prompt tokens prefilled (sums to the hit ratio)
        "cache_hit_ratio_by_tier": {tier: n / prompt if prompt else 0.0 for tier, n in by_tier.items()},
        "cached_tokens_by_tier": by_tier,
        "fetch_s": sum(w.stats.fetch_s for w in result.workers.values()),  # host/disk loads, all workers
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots)):
        for p in (50, 90, 99):
            summary[f"{name}_p{p}_s"] = percentile(values, p)
        summary[f"{name}_mean_s"] = sum(values) / len(values) if values else None
    busy = {
        w.worker_id: w.stats.busy_s / result.makespan_s if result.makespan_s else 0.0 for w in result.workers.values()
    }
    summary |= {
        "goodput_rps": good / span,
        # requests meeting both SLOs / every request of the trace: a rejected or failed one is a miss
        "goodput_fraction": good / len(requests) if requests else 0.0,
        "slo": {"ttft_s": ttft_slo_s, "tpot_s": tpot_slo_s},
        "trace_span_s": span,
        "makespan_s": result.makespan_s,
        "dispatches": result.timing.dispatches,
        "rejections": result.timing.rejections,
        "decisions": result.timing.decisions,
        "index_entries": result.index_entries,
        "index_bytes": result.index_bytes,
        "index_bytes_per_block": result.index_bytes / result.index_entries if result.index_entries else None,
        "utilisation": busy,
        "fleet": _fleet_record(result.settings),
        "ttft_samples_s": ttfts,
        "tpot_samples_s": tpots,
    }
    return summary


def timing_of(result: ReplayResult) -> dict:
    t = result.timing
    return {
        "policy": result.settings.policy,
        "wall_s": result.wall_s,
        "events": result.events,
        "core_wall_s": t.wall_s,
        "core_calls": t.calls,
        "decisions": t.decisions,
        "decisions_per_s": t.decisions / t.wall_s if t.wall_s else None,
        "us_per_core_call": 1e6 * t.wall_s / t.calls if t.calls else None,
        "core_by_method": {
            name: {"calls": int(calls), "wall_s": wall, "us_per_call": 1e6 * wall / calls}
            for name, (calls, wall) in sorted(t.by_method.items())
        },
    }


def _fleet_record(settings: ReplaySettings) -> dict:
    shape, cost = settings.shape, settings.cost
    return {
        "roles": dict(sorted(_count_roles(shape).items())),
        "cache_blocks": shape.cache_blocks,
        "host_cache_blocks": shape.host_cache_blocks,
        "disk_cache_blocks": shape.disk_cache_blocks,
        "kv_event_delay_s": settings.kv_event_delay_s,
        "report_delay_s": settings.report_delay_s,
        "prefill_token_budget": shape.prefill_token_budget,
        "kv_capacity_tokens": cost.kv_capacity_tokens,
        "chunk_tokens": cost.chunk_tokens,
        "max_queued_tokens": settings.max_queued_tokens,
        "local_prefill_max_tokens": settings.local_prefill_max_tokens,
        "time_scale": settings.time_scale,
        "seed": settings.seed,
    }


def _count_roles(shape: FleetShape) -> dict[str, int]:
    counts: dict[str, int] = {}
    for role in shape.roles.values():
        counts[role] = counts.get(role, 0) + 1
    return counts


def _describe(shape: FleetShape) -> str:
    roles = ", ".join(f"{n} {role}" for role, n in _count_roles(shape).items())
    tiers = f"{shape.cache_blocks} device"
    if shape.host_cache_blocks:
        tiers += f" + {shape.host_cache_blocks} host"
    if shape.disk_cache_blocks:
        tiers += f" + {shape.disk_cache_blocks} disk"
    return f"({roles}; {tiers} cache blocks each)"


def _span(requests: list[TraceRequest], scale: float) -> float:
    return (requests[-1].arrival_s - requests[0].arrival_s) * scale


def _progress_printer(policy: str):
    started = time.perf_counter()
    marks: dict[str, float] = {}

    def progress(done: int, total: int, now: float) -> None:
        tenth = done * 10 // total
        if tenth > marks.get("last", 0):
            marks["last"] = tenth
            print(
                f"  {policy}: {tenth * 10:>3}% of the trace arrived ({done}/{total}, "
                f"{now:.0f} s virtual, {time.perf_counter() - started:.1f} s wall)",
                flush=True,
            )

    return progress


def table(results: list[dict], timings: list[dict]) -> str:
    def ms(x: float | None) -> str:
        return f"{x * 1e3:>8.0f}" if x is not None else f"{'-':>8}"

    head = (
        f"{'policy':<20}{'mode':<14}{'hit':>6}{'h+d':>6}{'bound':>6}{'fleet':>6}{'TTFT p50':>9}{'p90':>8}{'p99':>8}"
        f"{'TPOT p50':>9}{'p90':>8}{'p99':>8}{'goodput':>8}{'good%':>6}{'rej':>6}{'wall s':>7}{'dec/s':>8}{'B/blk':>6}"
    )
    lines = [
        "",
        "times in ms; goodput in requests/s meeting the SLOs, good% of all requests (rejected ones miss);",
        "dec/s = core decisions per wall second;",
        "h+d: the part of hit served from host or disk tiers; bound: infinite cache;",
        "fleet: one LRU as large as all prefill caches together (every tier)",
        head,
    ]
    for r, t in zip(results, timings, strict=True):
        per_block = f"{r['index_bytes_per_block']:>6.0f}" if r["index_bytes_per_block"] else f"{'-':>6}"
        rate = f"{t['decisions_per_s']:>8.0f}" if t["decisions_per_s"] else f"{'-':>8}"
        off_device = r["cache_hit_ratio_by_tier"]["host"] + r["cache_hit_ratio_by_tier"]["disk"]
        lines.append(
            f"{r['policy']:<20}{r['mode']:<14}{r['cache_hit_ratio']:>6.3f}{off_device:>6.3f}{r['hit_ratio_bound']:>6.3f}"
            f"{r.get('hit_ratio_bound_fleet_cache', float('nan')):>6.3f}"
            f"{ms(r['ttft_p50_s']):>9}{ms(r['ttft_p90_s'])}{ms(r['ttft_p99_s'])}"
            f"{ms(r['tpot_p50_s']):>9}{ms(r['tpot_p90_s'])}{ms(r['tpot_p99_s'])}"
            f"{r['goodput_rps']:>8.2f}{r['goodput_fraction']:>6.1%}{r['rejected']:>6}{t['wall_s']:>7.1f}{rate}{per_block}"
        )
    return "\n".join(lines)


def plot_cdfs(results: list[dict], out: Path) -> None:
    for key, title, slo in (("ttft", "Time to first token", "ttft_s"), ("tpot", "Time per output token", "tpot_s")):
        fig, ax = plots.figure()
        for r in results:
            plots.cdf(ax, r[f"{key}_samples_s"], f"{r['policy']} ({r['mode']})")
        if results:
            ax.axvline(results[0]["slo"][slo], color="k", linestyle=":", label="SLO")
        plots.save(
            fig,
            ax,
            out / f"{key}_cdf.png",
            title=f"{title}, per policy (simulated fleet)",
            xlabel="seconds",
            ylabel="fraction of completed requests",
            log_x=True,
        )


__all__ = ["add_arguments", "parse_policies", "positive_int", "run", "settings_of", "summarize", "table"]
