"""``switchyard bench live``: a trace replayed through the running system, beside the
discrete-event simulation of the very same replay.

The stack is real (nats-server, scheduler, sim workers, ingress, each its own process,
as ``switchyard up`` starts them) and the requests are real HTTP/SSE. What it cannot be
is the trace's scale: Mooncake prompts average 12k tokens and its model runs on H100s.
So the replay is scaled, and scaled back when it is reported:

- tokens: every ``--token-scale`` trace tokens are one live token. A trace block (512
  tokens, one ``hash_id``) becomes ``512 / token-scale`` live tokens drawn from its id,
  so prompts sharing leading ids share leading tokens, and the ingress's chained keys
  see exactly the trace's prefix sharing. Requests longer than the tiny model's context
  are skipped (counted), in the live run and in its simulated twin alike.
- time: arrivals and every engine cost are multiplied by ``--time-scale``. Live costs
  come from ``bench.costmodel`` (the H100 calibration of ``bench sim``) without the
  terms the ``sim`` engine lacks (attention, KV reads, handoff time): the simulated twin
  runs with that same reduced model, so the two differ only by what the real fabric adds
  (processes, NATS, HTTP, Python) and by how the real workers batch.
- reported TTFT is live TTFT / time-scale; TPOT is live TPOT / (time-scale x token-scale).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
import httpx

from switchyard import procs
from switchyard.bench import plots
from switchyard.bench import stack as bench_stack
from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import FleetShape
from switchyard.bench.replay import ReplaySettings, replay
from switchyard.bench.sim import parse_policies, summarize
from switchyard.bench.stats import percentile
from switchyard.bench.traces import TRACE_BLOCK_SIZE, TraceRequest, hit_ratio_bound, read_trace

MODEL = "switchyard-sim"
CONTEXT = 4096  # the bundled sim-tiny model's
PEERS_AND_SWITCHYARD = "sglang_cache_aware,dynamo_kv,llmd,switchyard"  # the faithful peers beside ours


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL or Azure CSV trace")
    p.add_argument("--format", choices=["mooncake", "azure"], default=None)
    p.add_argument("--policies", default=PEERS_AND_SWITCHYARD, help="comma-separated; one live stack each")
    p.add_argument("--prefill", type=int, default=4, help="prefill workers (as bench sim)")
    p.add_argument("--decode", type=int, default=2, help="decode workers (as bench sim)")
    p.add_argument(
        "--colocated",
        action="store_true",
        help="the same number of workers, each of role both (prefill and decode; as bench sim)",
    )
    p.add_argument(
        "--lendable",
        action="store_true",
        help="the prefill workers of role both, beside the decode workers (switchyard may lend them; as bench sim)",
    )
    p.add_argument("--limit", type=int, default=400, help="the first N requests of the trace")
    p.add_argument("--time-scale", type=float, default=0.1, help="live seconds per trace second")
    p.add_argument(
        "--token-scale", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64], help="trace tokens per live token"
    )
    p.add_argument("--cache-blocks", type=int, default=CostModel().kv_capacity_tokens // TRACE_BLOCK_SIZE)
    p.add_argument("--out", type=Path, default=Path("bench/results/live"))
    p.add_argument("--ttft-slo-s", type=float, default=2.0)
    p.add_argument("--tpot-slo-s", type=float, default=0.05)


@dataclass(frozen=True)
class Scaling:
    time: float
    tokens: int

    @property
    def block_tokens(self) -> int:
        return TRACE_BLOCK_SIZE // self.tokens

    def live_tokens(self, trace_tokens: int) -> int:
        return math.ceil(trace_tokens / self.tokens)

    def fits(self, request: TraceRequest) -> bool:
        return self.live_tokens(request.input_tokens) + self.live_tokens(request.output_tokens) <= CONTEXT

    def prompt(self, request: TraceRequest) -> list[int]:
        """Live token ids: each trace block's from its hash id, so shared ids share tokens."""
        tokens: list[int] = []
        for block in request.block_ids:
            tokens += [256 + (block * 7919 + j * 104_729) % 3800 for j in range(self.block_tokens)]
        return tokens[: self.live_tokens(request.input_tokens)]


def live_cost(cost: CostModel) -> CostModel:
    """The calibrated model less what the ``sim`` engine does not model."""
    return replace(cost, attention_tokens=math.inf, decode_per_kv_token_s=0.0, link_bytes_per_s=math.inf)


def worker_flags(cost: CostModel, scaling: Scaling, cache_blocks: int) -> list[str]:
    t, k = scaling.time, scaling.tokens
    return [
        "--block-size",
        str(scaling.block_tokens),
        "--sim-cache-blocks",
        str(cache_blocks),
        "--sim-prefill-base-s",
        repr(cost.prefill_base_s * t),
        "--sim-prefill-per-token-s",
        repr(cost.per_token_s * k * t),
        # one live step stands for k trace steps: k tokens of every running sequence
        "--sim-decode-step-base-s",
        repr(cost.decode_base_s * k * t),
        "--sim-decode-step-per-seq-s",
        repr(cost.decode_per_seq_s * k * t),
        "--token-budget",
        str(max(1, cost.kv_capacity_tokens // k)),
    ]


def run(args: argparse.Namespace) -> int:
    policies = parse_policies(args.policies)
    scaling = Scaling(args.time_scale, args.token_scale)
    trace = read_trace(args.trace, args.format, args.limit)
    requests = [r for r in trace if scaling.fits(r)]
    skipped = len(trace) - len(requests)
    bound = hit_ratio_bound(requests)
    cost = live_cost(CostModel())
    print(
        f"{args.trace.name}: {len(requests)} requests ({skipped} longer than the live context skipped), "
        f"{requests[-1].arrival_s:.0f} s of trace in about {requests[-1].arrival_s * scaling.time:.0f} s live; "
        f"hit ratio bound {bound:.3f}",
        flush=True,
    )
    rows = []
    for policy in policies:
        live = _live_run(policy, requests, scaling, cost, args)
        twin = _sim_run(policy, requests, cost, args, bound)
        rows.append({"policy": policy, "live": live | {"skipped": skipped, "hit_ratio_bound": bound}, "sim": twin})
        print(f"  {policy}: live TTFT p50 {_ms(live['ttft_p50_s'])}, sim {_ms(twin['ttft_p50_s'])}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    public = [
        {
            k: v if not isinstance(v, dict) else {m: x for m, x in v.items() if not m.endswith("_samples_s")}
            for k, v in row.items()
        }
        for row in rows
    ]
    (args.out / "results.json").write_text(json.dumps(public, indent=2) + "\n")
    print(_table(rows), flush=True)
    _plot(rows, args.out)
    print(f"\nwrote {args.out / 'results.json'}, {args.out / 'live_vs_sim.png'}")
    return 0


def _sim_run(policy: str, requests: list[TraceRequest], cost: CostModel, args, bound: float) -> dict:
    shape = FleetShape(args.prefill, args.decode, args.colocated, args.cache_blocks, lendable=args.lendable)
    settings = ReplaySettings(
        policy=policy, shape=shape, cost=cost, ttft_slo_s=args.ttft_slo_s, tpot_slo_s=args.tpot_slo_s
    )
    mode = "colocated" if args.colocated else "disaggregated"
    summary = summarize(replay(requests, settings), bound, mode, args.ttft_slo_s, args.tpot_slo_s)
    return {k: v for k, v in summary.items() if not k.endswith("_samples_s")} | {
        "ttft_samples_s": summary.get("ttft_samples_s", [])
    }


# --- the live run --------------------------------------------------------------------------------


def _live_run(policy: str, requests: list[TraceRequest], scaling: Scaling, cost: CostModel, args) -> dict:
    fleet = {"prefill": args.prefill, "decode": args.decode}
    if args.colocated:  # the same workers, each of role both
        fleet = {"prefill": 0, "decode": 0, "colocated": args.prefill + args.decode}
    elif args.lendable:  # the prefill workers of role both
        fleet = {"prefill": 0, "decode": args.decode, "colocated": args.prefill}
    with ExitStack() as stack:
        server = stack.enter_context(procs.nats_server())
        live = bench_stack.start(
            stack,
            server,
            "--policy",
            policy,
            # the SLO the scheduler keeps (the switchyard policy's queueing), in live time
            "--ttft-slo-s",
            f"{args.ttft_slo_s * scaling.time:g}",
            # and the time per output token (colocated workers lent to decoding), in live time
            "--tpot-slo-s",
            f"{args.tpot_slo_s * scaling.time * scaling.tokens:g}",
            *worker_flags(cost, scaling, args.cache_blocks),
            **fleet,
        )
        samples = anyio.run(replay_http, live.url, requests, scaling)
    return summarize_live(policy, requests, samples, scaling, args)


@dataclass
class _Sample:
    status: int = 0
    ttft_s: float = -1.0
    span_s: float = 0.0  # first token to last
    completion: int = 0
    cached: int = 0
    prompt: int = 0


async def replay_http(url: str, requests: list[TraceRequest], scaling: Scaling) -> list[_Sample]:
    samples = [_Sample() for _ in requests]
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url + "/v1", timeout=600, limits=limits) as client:
        started = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i, request in enumerate(requests):
                delay = request.arrival_s * scaling.time - (time.perf_counter() - started)
                if delay > 0:
                    await anyio.sleep(delay)
                tg.start_soon(_one, client, request, scaling, samples[i])
    return samples


async def _one(client: httpx.AsyncClient, request: TraceRequest, scaling: Scaling, sample: _Sample) -> None:
    prompt = scaling.prompt(request)
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": scaling.live_tokens(request.output_tokens),
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    sample.prompt = len(prompt)
    sent = time.perf_counter()
    tail, first, last = b"", None, None
    async with client.stream("POST", "/completions", json=body) as response:
        sample.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return
        async for raw in response.aiter_raw():
            now = time.perf_counter()
            first = first if first is not None else now
            if b'"text":"' in raw:
                last = now
            tail = (tail + raw)[-4096:]
    if first is None or not bench_stack.COMPLETION_TOKENS.search(tail):
        sample.status = 599  # ended without its usage: an error event
        return
    sample.ttft_s = first - sent
    sample.span_s = (last or first) - first
    sample.completion = int(bench_stack.COMPLETION_TOKENS.findall(tail)[-1])
    sample.cached = int(bench_stack.CACHED_TOKENS.findall(tail)[-1])


def summarize_live(policy: str, requests: list[TraceRequest], samples: list[_Sample], scaling: Scaling, args) -> dict:
    done = [(r, s) for r, s in zip(requests, samples, strict=True) if s.status == 200]
    ttfts = [s.ttft_s / scaling.time for _, s in done]
    tpots = [s.span_s / (s.completion - 1) / (scaling.time * scaling.tokens) for _, s in done if s.completion > 1]
    good = sum(
        1
        for (_, s), ttft in zip(done, ttfts, strict=True)
        if ttft <= args.ttft_slo_s
        and (s.completion <= 1 or s.span_s / (s.completion - 1) / (scaling.time * scaling.tokens) <= args.tpot_slo_s)
    )
    span = (requests[-1].arrival_s - requests[0].arrival_s) or 1.0
    summary = {
        "policy": policy,
        "mode": "live",
        "requests": len(requests),
        "completed": len(done),
        "rejected": sum(s.status == 429 for s in samples),
        "failed": sum(s.status not in (200, 429) for s in samples),
        "cache_hit_ratio": sum(s.cached for _, s in done) / max(1, sum(s.prompt for _, s in done)),
        "goodput_rps": good / span,
        "ttft_samples_s": ttfts,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots)):
        for p in (50, 90, 99):
            summary[f"{name}_p{p}_s"] = percentile(values, p)
    return summary


# --- report ---------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def _table(rows: list[dict]) -> str:
    lines = [
        "",
        f"{'policy':<20}{'run':<6}{'done':>6}{'429':>5}{'hit':>7}{'TTFT p50':>11}{'TTFT p90':>11}"
        f"{'TPOT p50':>11}{'TPOT p90':>11}{'goodput/s':>11}",
    ]
    for row in rows:
        for run_name in ("live", "sim"):
            r = row[run_name]
            lines.append(
                f"{row['policy']:<20}{run_name:<6}{r['completed']:>6}{r['rejected']:>5}"
                f"{r['cache_hit_ratio']:>7.3f}{_ms(r['ttft_p50_s']):>11}{_ms(r['ttft_p90_s']):>11}"
                f"{_ms(r['tpot_p50_s']):>11}{_ms(r['tpot_p90_s']):>11}{r['goodput_rps']:>11.2f}"
            )
    return "\n".join(lines)


def _plot(rows: list[dict], out: Path) -> None:
    fig, ax = plots.figure()
    for row in rows:
        for run_name, style in (("live", "-"), ("sim", "--")):
            plots.cdf(ax, row[run_name].get("ttft_samples_s") or [], f"{row['policy']} {run_name}", style)
    plots.save(
        fig,
        ax,
        out / "live_vs_sim.png",
        title="Live replay against its simulation",
        xlabel="time to first token, trace seconds",
        ylabel="fraction of requests",
        log_x=True,
    )


__all__ = ["Scaling", "add_arguments", "live_cost", "run", "worker_flags"]
