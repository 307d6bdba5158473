"""``switchyard bench matrix``: load sweeps on every trace, fleet shape and cache users run,
and how ``switchyard`` compares with the best faithful peer in each.

    switchyard bench matrix --out bench/results/sim/matrix      # every case (its wall time: docs/bench-sim.md)
    switchyard bench matrix --cases mooncake-6p2d-device --limit 2000 --policies dynamo_kv,switchyard
    switchyard bench matrix --summarize-only                    # matrix.json again, from the sweeps there

A case is (trace, fleet shape, cache): the Mooncake conversation trace on a 6 prefill + 2
decode fleet, a 4 + 4 one and 8 colocated workers, each with device-only caches and with
host and disk tiers below them; the Azure conversation trace on 6 + 2 and colocated 8,
device-only (its requests carry no block ids: every block is new, so there is no prefix to
reuse and no tier could hold one). Each case is one ``bench sim --sweep`` (``bench.sweep``)
with the sim CLI's defaults (delays included) and its trace's time scales, which go from
light load to well past overload.

Writes ``CASE/sweep.json`` (and its plots) per case, then ``matrix.json``: per case, per
policy, its peak (saturation) load and what it serves there, its lightest point, and the
comparison of ``switchyard`` with the best peer, all read off the sweep points
(``compare``); prints a table and draws ``matrix_goodput.png``. Virtual-time figures only:
the same trace and flags give the same ``matrix.json`` byte for byte.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

from switchyard.bench import sim, sweep
from switchyard.bench.sim import parse_policies, positive_int, time_scales
from switchyard.bench.traces import TraceRequest, read_trace

ROOT = Path(__file__).resolve().parents[1]  # the repository: shared/ sits beside it
TRACES = ROOT.parent / "shared" / "data" / "traces"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"

PEERS = ("sglang_cache_aware", "dynamo_kv", "llmd", "llmd_precise")  # the faithful ports of other routers
OURS = "switchyard"
DEFAULT_POLICIES = ",".join((*PEERS, OURS))
# Time scales per trace, light load first. Mooncake (3.4 req/s of 7-20k-token prompts at
# scale 1) and Azure (5.5 req/s of ~1k-token prompts) load a fleet very differently; see
# docs/bench-sim.md, "Load sweeps across fleet shapes", for how each list was chosen.
SCALES = {
    "mooncake": (3.0, 2.0, 1.5, 1.0, 0.8, 0.65, 0.5, 0.4),
    "azure": (0.5, 0.25, 0.15, 0.12, 0.1, 0.08, 0.06),
}
DEVICE_BLOCKS = 878  # the cost model's HBM KV capacity, in 512-token blocks
TIERS = {
    "device": (DEVICE_BLOCKS, 0, 0),  # (device, host, disk) blocks per worker
    "tiered": (DEVICE_BLOCKS, 4000, 20000),
}


@dataclass(frozen=True)
class Case:
    trace: str  # a key of SCALES
    prefill: int  # with colocated: the workers (all of role "both") are prefill + decode
    decode: int
    colocated: bool
    cache: str  # a key of TIERS
    # Disaggregated, the prefill workers of role "both" (``bench sim --lendable``): every
    # policy runs on them; only ``switchyard`` lends them to decoding.
    lendable: bool = False

    @property
    def name(self) -> str:
        shape = f"colocated{self.prefill + self.decode}" if self.colocated else f"{self.prefill}p{self.decode}d"
        return f"{self.trace}-{shape}{'_lendable' if self.lendable else ''}-{self.cache}"

    def sim_argv(self) -> list[str]:
        """The ``bench sim`` flags of this case's fleet and cache."""
        device, host, disk = TIERS[self.cache]
        argv = ["--prefill", str(self.prefill), "--decode", str(self.decode), "--cache-blocks", str(device)]
        argv += ["--host-cache-blocks", str(host), "--disk-cache-blocks", str(disk)]
        return argv + (["--colocated"] if self.colocated else []) + (["--lendable"] if self.lendable else [])


CASES = (
    *(
        Case("mooncake", prefill, decode, colocated, cache)
        for prefill, decode, colocated in ((6, 2, False), (4, 4, False), (4, 4, True))
        for cache in ("device", "tiered")
    ),
    Case("azure", 6, 2, False, "device"),
    Case("azure", 4, 4, True, "device"),
    Case("mooncake", 6, 2, False, "device", lendable=True),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    names = ", ".join(c.name for c in CASES)
    p.add_argument("--out", type=Path, default=Path("bench/results/sim/matrix"), help="results folder")
    p.add_argument(
        "--mooncake", type=Path, default=MOONCAKE, help="the mooncake-* cases' trace (JSONL; default: conversation)"
    )
    p.add_argument("--azure", type=Path, default=AZURE, help="the Azure LLM inference conversation trace (CSV)")
    p.add_argument("--cases", default=None, help=f"comma-separated case names (default: all of {names})")
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policies")
    p.add_argument("--limit", type=positive_int, default=None, help="replay only each trace's first N requests")
    for trace, scales in SCALES.items():
        p.add_argument(
            f"--{trace}-sweep",
            type=time_scales,
            default=list(scales),
            metavar="SCALES",
            help=f"the {trace} cases' time scales, light load first (default {','.join(f'{x:g}' for x in scales)})",
        )
    p.add_argument("--jobs", type=positive_int, default=2, help="runs in this many processes at once")
    p.add_argument(
        "--merge",
        action="store_true",
        help="keep the other policies of each case's sweep.json already in --out: rerun one policy after a change to it",
    )
    p.add_argument(
        "--summarize-only",
        action="store_true",
        help="run nothing: matrix.json, its table and plot from the cases' sweep.json already in --out",
    )


def run(args: argparse.Namespace) -> int:
    cases = select_cases(args.cases)
    policies = parse_policies(args.policies)
    traces: dict[str, list[TraceRequest]] = {}
    started = time.perf_counter()
    for n, case in enumerate([] if args.summarize_only else cases, 1):
        case_args = sim_args(case, args, policies)
        if case.trace not in traces:
            traces[case.trace] = read_trace(case_args.trace, None, args.limit)
        print(f"\n=== case {n}/{len(cases)}: {case.name} ({time.perf_counter() - started:.0f} s so far)", flush=True)
        sweep.run(case_args, policies, traces[case.trace])
    record = matrix_record(cases, [_read_sweep(args.out / c.name) for c in cases])
    (args.out / "matrix.json").write_text(json.dumps(record, indent=2) + "\n")
    print(table(record), flush=True)
    plot(record, args.out / "matrix_goodput.png")
    print(f"\n{len(cases)} cases in {time.perf_counter() - started:.0f} s wall")
    print(f"wrote {args.out / 'matrix.json'}, {args.out / 'matrix_goodput.png'} and CASE/sweep.json per case")
    return 0


def select_cases(text: str | None) -> list[Case]:
    """The cases ``--cases`` names, in the matrix's order (all of them without it)."""
    if text is None:
        return list(CASES)
    wanted = [name.strip() for name in text.split(",") if name.strip()]
    known = {c.name for c in CASES}
    unknown = [name for name in wanted if name not in known]
    if unknown or not wanted:
        raise ValueError(f"unknown case {', '.join(map(repr, unknown)) or '(none given)'}; choose from {sorted(known)}")
    return [c for c in CASES if c.name in wanted]


def sim_args(case: Case, args: argparse.Namespace, policies: list[str]) -> argparse.Namespace:
    """The ``bench sim --sweep`` arguments of one case: its flags over the sim CLI's defaults."""
    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    trace = args.mooncake if case.trace == "mooncake" else args.azure
    argv = ["--trace", str(trace), "--policies", ",".join(policies), *case.sim_argv()]
    scales = ",".join(map(repr, getattr(args, f"{case.trace}_sweep")))  # repr: the float exactly
    argv += ["--sweep", scales, "--jobs", str(args.jobs)]
    if args.merge:
        argv.append("--merge")
    argv += ["--out", str(args.out / case.name)]
    if args.limit is not None:
        argv += ["--limit", str(args.limit)]
    return parser.parse_args(argv)


def _read_sweep(folder: Path) -> dict:
    return json.loads((folder / "sweep.json").read_text())


# --- the figures -------------------------------------------------------------------------------------


def matrix_record(cases: list[Case], sweeps: list[dict]) -> dict:
    """What ``matrix.json`` holds: each case's policies summarised and compared."""
    return {
        "peers": list(PEERS),
        "ours": OURS,
        "cases": {case.name: case_record(case, s) for case, s in zip(cases, sweeps, strict=True)},
    }


def case_record(case: Case, sweep: dict) -> dict:
    policies = {name: policy_summary(entry) for name, entry in sweep["policies"].items()}
    return {
        "trace": sweep["trace"],
        "shape": case.name.split("-")[1],
        "cache": case.cache,
        "fleet": sweep["fleet"],
        "requests": sweep["requests"],
        "time_scales": sweep["time_scales"],
        "policies": policies,
        "comparison": compare(sweep["policies"]),
    }


def policy_summary(entry: dict) -> dict:
    """One policy of a sweep: its peak point (see ``bench.sweep.saturation``) and its lightest."""
    points, s = entry["points"], entry["saturation"]
    peak = _at_load(points, s["peak_offered_rps"])
    light = points[0]
    return {
        "peak_offered_rps": s["peak_offered_rps"],
        "peak_goodput_rps": s["peak_goodput_rps"],
        "saturated": s["saturated"],
        "peak_goodput_fraction": peak["goodput_fraction"],
        "peak_completed_fraction": peak["completed_fraction"],
        "peak_ttft_p90_s": peak["ttft_p90_s"],
        "light_offered_rps": light["offered_rps"],
        "light_goodput_rps": light["goodput_rps"],
        "light_ttft_p90_s": light["ttft_p90_s"],
    }


def compare(sweep_policies: dict) -> dict | None:
    """``switchyard`` against the best peer of one case (None without both in the sweep).

    The best peer is the one with the highest peak goodput (ties: the first in ``PEERS``);
    at light load, the one with the highest goodput at the lightest point. Every figure is
    read off the sweep's points; ``goodput_ratio`` is ours over the peer's peak goodput.
    """
    peers = [p for p in PEERS if p in sweep_policies]
    if OURS not in sweep_policies or not peers:
        return None
    summary = {name: policy_summary(sweep_policies[name]) for name in (*peers, OURS)}
    ours = summary[OURS]
    best = max(peers, key=lambda p: (summary[p]["peak_goodput_rps"], -peers.index(p)))
    light_best = max(peers, key=lambda p: (summary[p]["light_goodput_rps"], -peers.index(p)))
    peer = summary[best]
    ours_there = _at_load(sweep_policies[OURS]["points"], peer["peak_offered_rps"])
    peer_ttfts = [summary[p]["peak_ttft_p90_s"] for p in peers if summary[p]["peak_ttft_p90_s"] is not None]
    return {
        "best_peer": best,
        "goodput_ratio": _ratio(ours["peak_goodput_rps"], peer["peak_goodput_rps"]),
        "peak_goodput_rps": {"ours": ours["peak_goodput_rps"], "peer": peer["peak_goodput_rps"]},
        "peak_offered_rps": {"ours": ours["peak_offered_rps"], "peer": peer["peak_offered_rps"]},
        # at the best peer's peak load, both
        "at_peer_peak_goodput_rps": {"ours": ours_there["goodput_rps"], "peer": peer["peak_goodput_rps"]},
        "at_peer_peak_ttft_p90_s": {"ours": ours_there["ttft_p90_s"], "peer": peer["peak_ttft_p90_s"]},
        # each at its own peak load
        "own_peak_ttft_p90_s": {"ours": ours["peak_ttft_p90_s"], "peer": peer["peak_ttft_p90_s"]},
        "best_peer_own_peak_ttft_p90_s": min(peer_ttfts) if peer_ttfts else None,
        "light_best_peer": light_best,
        "light_goodput_rps": {"ours": ours["light_goodput_rps"], "peer": summary[light_best]["light_goodput_rps"]},
        "light_ttft_p90_s": {"ours": ours["light_ttft_p90_s"], "peer": summary[light_best]["light_ttft_p90_s"]},
    }


def _at_load(points: list[dict], offered_rps: float) -> dict:
    """The point at this offered load (same trace and time scale: the same load exactly)."""
    (point,) = (p for p in points if p["offered_rps"] == offered_rps)
    return point


def _ratio(ours: float, peer: float) -> float | None:
    return ours / peer if peer else None


def table(record: dict) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    def pair(d: dict, fmt) -> str:
        return f"{fmt(d['ours'])} / {fmt(d['peer'])}"

    def rps(x: float) -> str:
        return f"{x:.2f}"

    lines = [
        "",
        "switchyard / best peer (by peak goodput; light load: by light-load goodput); req/s, ms",
        f"{'case':<30}{'best peer':<20}{'ratio':>6}{'peak load':>16}{'at peer peak: good':>20}{'TTFT p90':>14}"
        f"{'own-peak TTFT p90':>19}{'light good':>15}{'light TTFT p90':>16}",
    ]
    for name, case in record["cases"].items():
        c = case["comparison"]
        if c is None:
            lines.append(f"{name:<30}(no comparison: switchyard or every peer missing)")
            continue
        ratio = "-" if c["goodput_ratio"] is None else f"{c['goodput_ratio']:.2f}"
        lines.append(
            f"{name:<30}{c['best_peer']:<20}{ratio:>6}{pair(c['peak_offered_rps'], rps):>16}"
            f"{pair(c['at_peer_peak_goodput_rps'], rps):>20}{pair(c['at_peer_peak_ttft_p90_s'], ms):>14}"
            f"{pair(c['own_peak_ttft_p90_s'], ms):>19}{pair(c['light_goodput_rps'], rps):>15}"
            f"{pair(c['light_ttft_p90_s'], ms):>16}"
        )
    return "\n".join(lines)


def plot(record: dict, path: Path) -> None:
    """Goodput against offered load, one subplot per case, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["cases"])
    cols = min(3, len(names))
    rows = -(-len(names) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names, strict=False):
        sweep = _read_sweep(path.parent / name)
        for policy, entry in sweep["policies"].items():
            loads, goodputs = [p["offered_rps"] for p in entry["points"]], [p["goodput_rps"] for p in entry["points"]]
            ax.plot(loads, goodputs, "o-", label=policy)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("offered load, req/s")
        ax.set_ylabel("goodput, req/s")
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle("goodput vs offered load per case (simulated fleet)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m switchyard.bench.matrix", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


__all__ = ["CASES", "PEERS", "SCALES", "Case", "add_arguments", "compare", "main", "matrix_record", "run", "table"]

if __name__ == "__main__":
    raise SystemExit(main())
