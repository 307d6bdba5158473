"""The result tables of ``docs/bench-sim.md``, generated from the runs' ``results.json``.

Hand-copied figures drift from what the code produces; so every table of results in the doc
sits between two markers and is rewritten from a run's files, never edited by hand:

    <!-- bench-sim:begin mooncake-colocated -->          one row per policy (results.json)
    <!-- bench-sim:end mooncake-colocated -->
    <!-- bench-sim:begin mooncake-1000-workers:timing --> the core's wall-clock cost (timing.json)
    <!-- bench-sim:end mooncake-1000-workers:timing -->

A name is a run: the folder ``switchyard bench sim --out`` wrote (which also holds these
tables, ``tables.md``). The doc's runs are kept, less each worker's utilisation (one entry a
worker, 1,000 of them in the largest run), in ``docs/bench-sim.results.json``, so a unit test
can check that the doc says exactly what those results say:

    switchyard bench sim ... --out bench/results/sim/NAME           # each run the doc names
    python -m switchyard.bench.simdoc --runs bench/results/sim      # keep them, rewrite the doc
    python -m switchyard.bench.simdoc --check                       # exit 1 if the doc differs

The policy tables hold virtual-time figures only, so rerunning a documented command gives the
same table byte for byte; wall-clock figures vary from run to run and appear only in the
``:timing`` tables, as one recorded run.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from switchyard.schemas import SwitchyardError

DOC = Path("docs/bench-sim.md")
RESULTS = Path("docs/bench-sim.results.json")
# A marker is a line of its own, so the doc can mention one in prose.
_BLOCK = re.compile(r"^<!-- bench-sim:begin (?P<name>\S+) -->\n.*?^<!-- bench-sim:end (?P=name) -->$", re.S | re.M)
_BEGIN = re.compile(r"^<!-- bench-sim:begin (\S+) -->$", re.M)
_ROLE_ORDER = ("prefill", "decode", "both")
_TIERS = ("device", "host", "disk")


class DocError(SwitchyardError, ValueError):
    """The doc's markers do not pair up, or name a run or table there are no results for."""


# --- the tables -----------------------------------------------------------------------------------


def tables(run: dict) -> str:
    """Both tables of one run (``{"results": [...], "timing": [...]}``), as ``tables.md`` holds them."""
    return f"{policy_table(run['results'])}\n\n{timing_table(run['timing'])}\n"


def policy_table(results: list[dict]) -> str:
    """A caption (the trace and the fleet), then one row per policy; from results.json alone."""
    local = any(r["dispatches"].get("local") for r in results)
    # Columns that runs older than host/disk tiers and goodput_fraction lack are left out for them.
    tiered = any(_tier_blocks(r["fleet"]) for r in results)
    fraction = all("goodput_fraction" in r for r in results)
    head = (
        f"| policy | hit |{' hit device / host / disk |' if tiered else ''} bound | fleet LRU "
        "| TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms "
        f"| goodput req/s |{' goodput % |' if fraction else ''} rejected |{' local prefills |' if local else ''} "
        "index entries | B/block |"
    )
    lines = [_caption(results[0]), "", head, "|---" * head.count(" |") + "|"]
    for r in results:
        cells = [
            r["policy"],
            f"{r['cache_hit_ratio']:.3f}",
            *([" / ".join(f"{r['cache_hit_ratio_by_tier'][t]:.3f}" for t in _TIERS)] if tiered else []),
            f"{r['hit_ratio_bound']:.3f}",
            f"{r['hit_ratio_bound_fleet_cache']:.3f}",
            " / ".join(_ms(r[f"ttft_p{p}_s"]) for p in (50, 90, 99)),
            " / ".join(_ms(r[f"tpot_p{p}_s"]) for p in (50, 90, 99)),
            f"{r['goodput_rps']:.2f}",
            *([f"{r['goodput_fraction']:.1%}".replace("%", "")] if fraction else []),
            f"{r['rejected']:,}",
            *([f"{r['dispatches'].get('local', 0):,}"] if local else []),
            f"{r['index_entries']:,}",
            "-" if r["index_bytes_per_block"] is None else f"{r['index_bytes_per_block']:.0f}",
        ]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def timing_table(timings: list[dict]) -> str:
    """Wall-clock cost of the core per policy, from timing.json: one run on one machine."""
    lines = ["| policy | wall s (whole trace) | decisions/s | us per `submit` |", "|---|---|---|---|"]
    for t in timings:
        submit = t["core_by_method"].get("submit")
        rate = "-" if t["decisions_per_s"] is None else f"{t['decisions_per_s']:,.0f}"
        per_submit = "-" if submit is None else f"{submit['us_per_call']:,.0f}"
        lines.append(f"| {t['policy']} | {t['wall_s']:.1f} | {rate} | {per_submit} |")
    return "\n".join(lines)


def _caption(r: dict) -> str:
    fleet = r["fleet"]
    roles = " + ".join(f"{fleet['roles'][role]:,} `{role}`" for role in _ROLE_ORDER if role in fleet["roles"])
    parts = [
        f"{r['requests']:,} requests over {r['trace_span_s']:,.0f} s ({r['requests'] / r['trace_span_s']:.2f} req/s)",
        f"{r['mode']}, {roles} workers, {_cache(fleet)} cache blocks each",
    ]
    if fleet.get("kv_event_delay_s") or fleet.get("report_delay_s"):  # absent from older runs
        parts.append(
            f"KV events reach the core {fleet['kv_event_delay_s'] * 1e3:g} ms late, "
            f"worker events {fleet['report_delay_s'] * 1e3:g} ms"
        )
    if fleet["time_scale"] != 1:
        parts.append(f"time scale {fleet['time_scale']:g}")
    if fleet["local_prefill_max_tokens"]:
        parts.append(f"local prefill up to {fleet['local_prefill_max_tokens']:,} uncached tokens")
    parts.append(f"goodput: TTFT <= {r['slo']['ttft_s']:g} s and TPOT <= {r['slo']['tpot_s'] * 1e3:g} ms")
    return "; ".join(parts) + "."


def _tier_blocks(fleet: dict) -> int:
    """Host and disk blocks a worker of this fleet has (0 for runs from before tiers)."""
    return fleet.get("host_cache_blocks", 0) + fleet.get("disk_cache_blocks", 0)


def _cache(fleet: dict) -> str:
    if not _tier_blocks(fleet):
        return f"{fleet['cache_blocks']:,}"
    tiers = [f"{fleet['cache_blocks']:,} device"]
    tiers += [f"{fleet[f'{t}_cache_blocks']:,} {t}" for t in ("host", "disk") if fleet[f"{t}_cache_blocks"]]
    return " + ".join(tiers)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


# --- the doc --------------------------------------------------------------------------------------


def rewrite(doc: str, runs: dict[str, dict]) -> str:
    """``doc`` with every marked table regenerated from ``runs`` (run name -> its record)."""
    begins = _BEGIN.findall(doc)
    blocks = [m["name"] for m in _BLOCK.finditer(doc)]
    if begins != blocks:
        raise DocError(f"unpaired bench-sim markers: begin {begins}, begin..end pairs {blocks}")
    return _BLOCK.sub(lambda m: _block(m["name"], runs), doc)


def run_names(doc: str) -> list[str]:
    """The runs the doc's tables are made from, in order of first appearance."""
    return list(dict.fromkeys(name.partition(":")[0] for name in _BEGIN.findall(doc)))


def read_run(folder: Path) -> dict:
    """A run as the doc keeps it: its results less per-worker utilisation, and its timing."""
    results = json.loads((folder / "results.json").read_text())
    timing = json.loads((folder / "timing.json").read_text())
    return {"results": [{k: v for k, v in r.items() if k != "utilisation"} for r in results], "timing": timing}


def _block(name: str, runs: dict[str, dict]) -> str:
    run, _, kind = name.partition(":")
    if run not in runs:
        raise DocError(f"no results for run {run!r} (marker {name!r})")
    match kind:
        case "":
            body = policy_table(runs[run]["results"])
        case "timing":
            body = timing_table(runs[run]["timing"])
        case _:
            raise DocError(f"unknown table {kind!r} in marker {name!r}; there are '' and 'timing'")
    return f"<!-- bench-sim:begin {name} -->\n{body}\n<!-- bench-sim:end {name} -->"


# --- the command ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m switchyard.bench.simdoc", description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=Path, default=DOC)
    p.add_argument("--results", type=Path, default=RESULTS, help="the doc's runs, kept beside it")
    p.add_argument("--runs", type=Path, default=None, help="read the doc's runs from RUNS/NAME/ first")
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if the doc is not what it gives")
    args = p.parse_args(argv)
    doc = args.doc.read_text()
    if args.runs is not None:
        runs = {name: read_run(args.runs / name) for name in run_names(doc)}
        if not args.check:
            args.results.write_text(json.dumps(runs, indent=1) + "\n")
    else:
        runs = json.loads(args.results.read_text())
    new = rewrite(doc, runs)
    if args.check:
        if new != doc:
            print(f"{args.doc}: its tables are not what {args.runs or args.results} gives", file=sys.stderr)
            return 1
        return 0
    args.doc.write_text(new)
    print(f"rewrote {len(_BEGIN.findall(doc))} tables in {args.doc}" + (f", kept {args.results}" if args.runs else ""))
    return 0


__all__ = ["DocError", "main", "policy_table", "read_run", "rewrite", "run_names", "tables", "timing_table"]

if __name__ == "__main__":
    raise SystemExit(main())
