"""``switchyard bench federation``: regions side by side, in virtual time and live.

    switchyard bench federation --trace ../shared/data/traces/mooncake_conversation_trace.jsonl \\
        --out bench/results/federation                 # both halves; --sim-only, --live-only

**The simulated half** is ``bench.federation_sim`` with its own defaults (512 simulated
workers, 50x the trace's rate, the whole trace), written to ``<out>/sim``.

**The live half** (``<out>/live``) runs the same trace split (``split_by_region``: sessions
homed 0.6/0.25/0.15 in us/eu/ap, 20% of later turns entering elsewhere) through the real
system, once per region policy, each on a fresh set of regions:

- three regions on this machine, each its own nats-server (``switchyard.wan.local_regions``,
  joined as a supercluster) behind its WAN relay, and its own ``switchyard up --nats URL
  --region R`` (scheduler, ``--prefill`` + ``--decode`` sim workers, a federated ingress with
  ``--region-policy``; no batch runner), every process of a region its own;
- the workers run ``bench live``'s scaled cost model (``Scaling``, ``worker_flags``,
  ``live_cost``: the H100 calibration less what the sim engine lacks); arrivals are the
  trace's divided by ``--live-rate`` and times ``--time-scale``; reported TTFTs are live
  TTFT / time-scale, as ``bench live`` reports them. The round trips are scaled the same way
  (the relays delay by ``--rtts`` x time-scale), so a TTFT scaled back carries the trace-scale
  round trip, not ten of them;
- each request goes to its entry region's ingress at its scaled arrival, with
  ``x-session-affinity: <session>``;
- at ``--kill-at`` of the trace's span the region ``--kill`` is lost: its nats-server, its
  relay and its ``up`` with every descendant are SIGKILLed (psutil, recursive), and nothing
  restarts them. **Client-side failover** is assumed: from the kill on, a request whose entry
  region is dead is sent to the nearest live region's ingress (by round trip), as if DNS or an
  anycast address turned at once; its TTFT counts that round trip (added, as the sim adds it;
  the ingresses themselves are all on loopback). Requests in flight on the dead ingress are
  lost with it.

Figures per policy, over the requests arriving before the kill (**steady**) and after it
(**failover**): cache hit ratio (cached_tokens / prompt_tokens of the usage of the completed
requests), TTFT p50/p90 (scaled back), goodput (TTFT within ``--ttft-slo-s``, the sim's SLO in
trace seconds; 429s, errors and lost streams miss it), errors, and the cross-region share
(routes to another region / all routes, from each ingress's
``switchyard_region_routes_total{region,reason}``: steady scraped just before the kill,
failover the survivors' counts after it).

Each policy also runs once **without the kill** (``--no-baseline`` skips it), on fresh regions:
its second half is the failover phase's reference (the *no kill* rows).

**Recovery time**, as the sim defines it: the requests arriving after the kill whose client or
whose session's home is the killed region are *touched*; one is *hurt* when it failed, or
missed the SLO that it met in the run without the kill. Over the touched ones in arrival
order, a window of ``RECOVERY_WINDOW`` is bad with more than ``RECOVERY_HURT_SHARE`` of it
hurt; recovery is from the kill to the arrival (trace seconds) of the last request of the last
bad window; 0 when none is bad; ``null`` ("never") when the last window is still bad. The
window is smaller than the sim's (20, not 100): the live half has fewer requests.

Time-based settings of the fabric are scaled where they decide a route: the schedulers'
``--spill-wait-s`` (trace seconds, x time-scale); summaries every
``--live-summary-interval-s`` and dark after ``--live-dark-after-s`` are live seconds (longer,
in trace terms, than the sim's: shorter misfires on two loaded cores).

Writes ``<out>/live/results.json``, ``ttft_cdf.png``, ``goodput_hit.png``,
``timeline_good.png``, ``timeline_ttft.png`` and ``tables.md`` (both halves' tables, as
docs/bench-federation.md shows them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx

from switchyard import procs, wan
from switchyard.bench import federation_sim, plots
from switchyard.bench import stack as bench_stack
from switchyard.bench.costmodel import CostModel
from switchyard.bench.federation_sim import FederatedRequest, parse_policies, parse_rtts, split_by_region
from switchyard.bench.live import Scaling, live_cost, worker_flags
from switchyard.bench.stats import percentile
from switchyard.bench.traces import TRACE_BLOCK_SIZE, hit_ratio_bound, read_trace

MODEL = "switchyard-sim"
DEFAULT_OUT = Path("bench/results/federation")
RECOVERY_WINDOW = 20  # consecutive touched requests (module notes: recovery time)
RECOVERY_HURT_SHARE = 0.1  # a window with more of them hurt is bad
READY_TIMEOUT_S = 90.0

# What a request ended as, beside its HTTP status
ERROR_EVENT = 599  # a 200 stream that ended without its usage (an error event)
CONNECTION_LOST = 598  # the connection failed (its ingress died)
HUNG = 597  # no end within --request-timeout-s


def add_arguments(p: argparse.ArgumentParser) -> None:
    federation_sim.add_arguments(p)  # the shared flags (trace, regions, rtts, policies, kill, SLO) and the sim's
    p.set_defaults(out=DEFAULT_OUT)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--sim-only", action="store_true", help="only the simulated half")
    mode.add_argument("--live-only", action="store_true", help="only the live half")
    live = p.add_argument_group("live half")
    live.add_argument("--live-limit", type=int, default=600, help="the first N requests of the trace")
    live.add_argument("--live-rate", type=float, default=1.0, help="times the trace's arrival rate")
    live.add_argument("--prefill", type=int, default=2, help="prefill workers per region")
    live.add_argument("--decode", type=int, default=1, help="decode workers per region")
    live.add_argument("--time-scale", type=float, default=0.1, help="live seconds per trace second")
    live.add_argument("--token-scale", type=int, default=16, choices=[1, 2, 4, 8, 16, 32, 64])
    live.add_argument("--live-cache-blocks", type=int, default=CostModel().kv_capacity_tokens // TRACE_BLOCK_SIZE)
    live.add_argument("--live-summary-interval-s", type=float, default=0.1, help="live seconds")
    live.add_argument("--live-dark-after-s", type=float, default=1.0, help="live seconds")
    live.add_argument(
        "--spill-wait-s",
        type=float,
        default=2.0,
        help="the schedulers' spill threshold in trace seconds (the scheduler's default), scaled like every cost",
    )
    live.add_argument(
        "--spill-margin-s",
        type=float,
        default=0.5,
        help="the ingresses' geo spill margin in trace seconds (the ingress's default), scaled like every cost",
    )
    live.add_argument("--no-baseline", action="store_true", help="skip the runs without the kill (no recovery time)")
    live.add_argument("--request-timeout-s", type=float, default=120.0, help="live; a request longer is hung")


def run(args: argparse.Namespace) -> int:
    if not args.live_only:
        federation_sim.run_sim(_with(args, out=args.out / "sim"))
    if not args.sim_only:
        run_live(args)
    write_tables(args.out)
    return 0


def _with(args: argparse.Namespace, **changes) -> argparse.Namespace:
    return argparse.Namespace(**(vars(args) | changes))


# --- the regions ---------------------------------------------------------------------------------


@dataclass
class Region:
    local: wan.LocalRegion
    port: int  # its ingress's
    processes: list[subprocess.Popen] = field(default_factory=list)  # nats-server, relay, up
    alive: bool = True

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class LiveRegions:
    """Regions on this machine, each its nats-server, relay and ``switchyard up``."""

    def __init__(self, names: Sequence[str], folder: Path, rtt: wan.RttTable, up_flags: Sequence[str]) -> None:
        self.folder = folder
        self.regions = {r.name: Region(r, procs.free_port()) for r in wan.local_regions(names, folder, rtt)}
        self.rtt = rtt
        self.up_flags = list(up_flags)
        self._logs = ExitStack()

    def __enter__(self) -> LiveRegions:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        for region in self.regions.values():
            log = self._log(f"{region.local.name}-nats.log")
            region.processes += [
                procs.spawn(region.local.nats_command, stdout=log),
                procs.spawn(region.local.relay_command, env=procs.child_env(), stdout=log),
            ]
        for region in self.regions.values():
            spec, (server, relay) = region.local.spec, region.processes
            procs.wait_for_port(spec.host, spec.client_port, 15.0, server)
            procs.wait_for_port(spec.host, spec.gateway.port, 15.0, relay)
        _wait(lambda: wan.not_ready([r.local for r in self.regions.values()]), READY_TIMEOUT_S, "gateways")
        for name, region in self.regions.items():
            command = procs.service_command(
                "up",
                "--nats",
                region.local.client_url,
                "--region",
                name,
                "--port",
                str(region.port),
                "--data-dir",
                str(self.folder / f"{name}-data"),
                *self.up_flags,
            )
            region.processes.append(procs.spawn(command, env=procs.child_env(), stdout=self._log(f"{name}-up.log")))
        _wait(self._services_not_ready, READY_TIMEOUT_S, "regions' services")

    def _log(self, name: str):
        return self._logs.enter_context(open(self.folder / name, "ab"))

    def _services_not_ready(self) -> str:
        names = list(self.regions)
        for name, region in self.regions.items():
            if region.processes[-1].poll() is not None:
                raise procs.ProcessError(f"{name}'s switchyard up exited: {_tail(self.folder / f'{name}-up.log')}")
            try:
                health = httpx.get(region.url + "/health", timeout=1).json()
                metrics = httpx.get(region.url + "/metrics", timeout=1).text
            except (httpx.HTTPError, ValueError) as exc:
                return f"{name}: {exc!r}"
            if not (health.get("prefill_workers") and health.get("decode_workers")):
                return f"{name}: {health}"
            for other in names:
                if f'switchyard_region_alive{{region="{other}"}} 1.0' not in metrics:
                    return f"{name} has not heard {other}"
        return ""

    def nearest_alive(self, name: str) -> str:
        if self.regions[name].alive:
            return name
        others = [r for r, region in self.regions.items() if region.alive]
        return min(others, key=lambda r: (self.rtt.rtt_ms(name, r), r))

    def kill(self, name: str) -> None:
        """SIGKILL every process of the region, its ``up``'s descendants included (collected
        first: once ``up`` is gone they would be orphans, found by nobody)."""
        import psutil  # a bench extra; the CLI imports this module without it

        region = self.regions[name]
        region.alive = False
        victims = list(region.processes)
        try:
            victims += psutil.Process(region.processes[-1].pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
        for proc in victims:
            try:
                proc.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        for proc in region.processes:
            proc.wait()

    def close(self) -> None:
        ups = [r.processes[2] for r in self.regions.values() if len(r.processes) > 2]
        procs.stop(ups, timeout_s=20.0)  # each stops its own children
        procs.stop([p for r in self.regions.values() for p in r.processes[:2]])
        self._logs.close()


def _wait(not_ready, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while (missing := not_ready()) and time.monotonic() < deadline:
        time.sleep(0.1)
    if missing:
        raise procs.ProcessError(f"{what} not ready within {timeout_s:.0f} s: {missing}")


def _tail(path: Path, chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


# --- one run: the replay over HTTP, the kill, the scrapes -------------------------------------------


@dataclass
class Sample:
    entry: str = ""  # the ingress it was sent to
    sent_s: float = -1.0  # live seconds since the replay started
    after_kill: bool = False  # sent once the kill was done
    client_rtt_s: float = 0.0  # live: to the ingress it was sent to, when not its own region's
    status: int = 0  # HTTP status, or ERROR_EVENT / CONNECTION_LOST / HUNG
    ttft_s: float = -1.0  # live
    cached: int = 0
    prompt: int = 0


@dataclass
class Scrape:
    """Each ingress's region routes (ingress -> {(region, reason): count})."""

    routes: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)


_ROUTES = re.compile(
    r'^switchyard_region_routes_total\{reason="(?P<reason>[^"]*)",region="(?P<region>[^"]*)"\} (?P<n>\S+)$', re.M
)


def routes_from_metrics(text: str) -> dict[tuple[str, str], float]:
    """An ingress's ``/metrics`` -> {(region, reason): requests routed}."""
    return {(m["region"], m["reason"]): float(m["n"]) for m in _ROUTES.finditer(text)}


async def _scrape(client: httpx.AsyncClient, fleet: LiveRegions) -> Scrape:
    scrape = Scrape()
    for name, region in fleet.regions.items():
        if not region.alive:
            continue
        scrape.routes[name] = routes_from_metrics((await client.get(region.url + "/metrics", timeout=5)).text)
    return scrape


@dataclass
class Replay:
    fleet: LiveRegions
    requests: list[FederatedRequest]
    scaling: Scaling
    rate: float
    kill: str | None
    kill_at_s: float  # live
    timeout_s: float
    samples: list[Sample] = field(default_factory=list)
    before_kill: Scrape = field(default_factory=Scrape)
    at_end: Scrape = field(default_factory=Scrape)

    def arrival(self, fr: FederatedRequest) -> float:
        return fr.request.arrival_s / self.rate * self.scaling.time

    async def run(self) -> Replay:
        self.samples = [Sample() for _ in self.requests]
        limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits) as client:
            started = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for fr, sample in zip(self.requests, self.samples, strict=True):
                    arrival = self.arrival(fr)
                    if self.kill is not None and self.fleet.regions[self.kill].alive and arrival >= self.kill_at_s:
                        await _sleep_until(started, self.kill_at_s)
                        await self._kill(client)
                    await _sleep_until(started, arrival)
                    # the kill is done here, between two sends: no request races it
                    sample.after_kill = self.kill is not None and not self.fleet.regions[self.kill].alive
                    sample.entry = self.fleet.nearest_alive(fr.ingress)
                    sample.client_rtt_s = self.fleet.rtt.rtt_ms(fr.ingress, sample.entry) / 1000
                    sample.sent_s = time.perf_counter() - started
                    tg.start_soon(self._one, client, fr, sample)
            self.at_end = await _scrape(client, self.fleet)
        return self

    async def _kill(self, client: httpx.AsyncClient) -> None:
        assert self.kill is not None
        self.before_kill = await _scrape(client, self.fleet)
        self.fleet.kill(self.kill)  # at once: a loss, not a drain

    async def _one(self, client: httpx.AsyncClient, fr: FederatedRequest, sample: Sample) -> None:
        prompt = self.scaling.prompt(fr.request)
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": self.scaling.live_tokens(fr.request.output_tokens),
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
        }
        sample.prompt = len(prompt)
        url = self.fleet.regions[sample.entry].url + "/v1/completions"
        headers = {"x-session-affinity": str(fr.session)}
        with anyio.move_on_after(self.timeout_s) as scope:
            try:
                await _stream(client, url, body, headers, sample)
            except httpx.HTTPError:
                sample.status = CONNECTION_LOST
        if scope.cancelled_caught:
            sample.status = HUNG


async def _sleep_until(started: float, at_s: float) -> None:
    delay = at_s - (time.perf_counter() - started)
    if delay > 0:
        await anyio.sleep(delay)


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, sample: Sample) -> None:
    sent = time.perf_counter()
    tail, first = b"", None
    async with client.stream("POST", url, json=body, headers=headers) as response:
        sample.status = response.status_code
        if response.status_code != 200:
            await response.aread()
            return
        async for raw in response.aiter_raw():
            first = first if first is not None else time.perf_counter()
            tail = (tail + raw)[-4096:]
    if first is None or not bench_stack.COMPLETION_TOKENS.search(tail):
        sample.status = ERROR_EVENT
        return
    sample.ttft_s = first - sent
    sample.cached = int(bench_stack.CACHED_TOKENS.findall(tail)[-1])


# --- the live half -----------------------------------------------------------------------------------


def run_live(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    policies = parse_policies(args.policies)
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    if args.kill and args.kill not in regions:
        raise ValueError(f"--kill {args.kill!r}: not one of {', '.join(regions)}")
    scaling = Scaling(args.time_scale, args.token_scale)
    rtts = parse_rtts(args.rtts, regions)
    trace = read_trace(args.trace, "mooncake", args.live_limit)
    split = [
        fr
        for fr in split_by_region(trace, regions, _weights(args), args.travel_share, args.seed)
        if scaling.fits(fr.request)
    ]
    span = split[-1].request.arrival_s - split[0].request.arrival_s
    kill_at_trace = args.kill_at * span / args.live_rate
    settings = _settings(
        args,
        regions,
        rtts,
        split,
        len(trace) - len(split),
        kill_at_trace,
        hit_ratio_bound([fr.request for fr in split]),
    )
    log(
        f"live: {len(split)} requests ({settings['skipped']} over the live context skipped) over "
        f"{span / args.live_rate * scaling.time:.0f} s live, by ingress {settings['by_ingress']}; "
        f"{args.kill or 'no region'} killed at {kill_at_trace * scaling.time:.1f} s live"
    )
    rows = []
    kill_at_live = kill_at_trace * scaling.time
    for policy in policies:
        started = time.monotonic()
        baseline = None
        if args.kill and not args.no_baseline:
            baseline = _run_policy(policy, split, scaling, rtts, args, None, kill_at_live)
        replay = _run_policy(policy, split, scaling, rtts, args, args.kill or None, kill_at_live)
        row = summarize(policy, replay, args, baseline)
        row["wall_s"] = time.monotonic() - started
        # two cores: another process running beside the bench shows here (and in every figure)
        row["load_avg_1m_after"] = os.getloadavg()[0]
        rows.append(row)
        after = row["failover"].get("goodput_share")
        log(
            f"  {policy}: steady TTFT p90 {_ms(row['steady']['ttft_p90_s'])} ms, goodput "
            f"{_share(row['steady']['goodput_share'])}; after the kill {_share(after)} ({row['wall_s']:.0f} s wall, "
            f"load average {row['load_avg_1m_after']:.1f})"
        )
    results = {"settings": settings, "runs": rows}
    out = args.out / "live"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    if not args.no_plots:
        plot(results, out)
    log(live_table(results))
    return results


def _weights(args: argparse.Namespace) -> list[float]:
    return [float(w) for w in args.weights.split(",")]


def _settings(args, regions, rtts, split, skipped: int, kill_at_trace: float, bound: float) -> dict:
    return {
        "trace": args.trace.name,
        "requests": len(split),
        "skipped": skipped,
        "sessions": len({fr.session for fr in split}),
        "by_ingress": {r: sum(1 for fr in split if fr.ingress == r) for r in regions},
        "travelling": sum(1 for fr in split if fr.ingress != fr.home),
        "regions": regions,
        "weights": _weights(args),
        "travel_share": args.travel_share,
        "rtt_s": {f"{a}-{b}": v for (a, b), v in rtts.items() if regions.index(a) < regions.index(b)},
        "fleet": {"prefill": args.prefill, "decode": args.decode, "cache_blocks": args.live_cache_blocks},
        "rate": args.live_rate,
        "time_scale": args.time_scale,
        "token_scale": args.token_scale,
        "summary_interval_s_live": args.live_summary_interval_s,
        "dark_after_s_live": args.live_dark_after_s,
        "spill_wait_s": args.spill_wait_s,
        "spill_margin_s": args.spill_margin_s,
        "ttft_slo_s": args.ttft_slo_s,
        "kill": args.kill or None,
        "kill_at_s": kill_at_trace,  # trace seconds (divided by the rate)
        "recovery_window": RECOVERY_WINDOW,
        "recovery_hurt_share": RECOVERY_HURT_SHARE,
        "baseline": not args.no_baseline,
        "hit_ratio_bound": bound,
        "seed": args.seed,
    }


def _run_policy(policy, split, scaling: Scaling, rtts, args, kill: str | None, kill_at_live: float) -> Replay:
    rtt = wan.RttTable({frozenset(pair): s * 1000 * scaling.time for pair, s in rtts.items()})
    up_flags = [
        "--log-level",
        "warning",
        "--batch-runners",
        "0",
        "--prefill",
        str(args.prefill),
        "--decode",
        str(args.decode),
        "--region-policy",
        policy,
        "--summary-interval-s",
        repr(args.live_summary_interval_s),
        "--region-dark-after-s",
        repr(args.live_dark_after_s),
        "--spill-wait-s",
        repr(args.spill_wait_s * scaling.time),
        "--region-spill-margin-s",
        repr(args.spill_margin_s * scaling.time),
        *worker_flags(live_cost(CostModel()), scaling, args.live_cache_blocks),
    ]
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    with tempfile.TemporaryDirectory(prefix="switchyard-federation-") as folder:
        with LiveRegions(regions, Path(folder), rtt, up_flags) as fleet:
            replay = Replay(fleet, split, scaling, args.live_rate, kill, kill_at_live, args.request_timeout_s)
            return anyio.run(replay.run)


# --- figures --------------------------------------------------------------------------------------


def summarize(policy: str, replay: Replay, args: argparse.Namespace, baseline: Replay | None = None) -> dict:
    """Steady: the requests arriving before the kill, less those the kill took in flight on the
    killed region's ingress (``lost_in_flight``); failover: those arriving after it. ``baseline``:
    the same replay without the kill (its second half is the failover phase's reference)."""
    t = replay.scaling.time
    kill_at = replay.kill_at_s / t  # trace seconds
    ttfts = _ttfts(replay)  # the client's round trip to another region's ingress included
    arrivals = [replay.arrival(fr) / t for fr in replay.requests]  # trace seconds, divided by the rate
    lost = [
        i for i, s in enumerate(replay.samples) if not s.after_kill and s.entry == replay.kill and s.status in _LOST
    ]
    before = [i for i, a in enumerate(arrivals) if a < kill_at and i not in lost]
    after = [i for i, a in enumerate(arrivals) if a >= kill_at]
    routes = replay.before_kill.routes if replay.kill else replay.at_end.routes
    steady = _phase(replay, before, ttfts, args.ttft_slo_s) | {"cross_region_share": cross_share(routes)}
    row = {
        "policy": policy,
        "steady": steady | {"routes": _routes_record(routes)},
        "failover": {},
        "hung": sum(1 for s in replay.samples if s.status == HUNG),
        "statuses": _count(str(s.status) for s in replay.samples),
        "samples": [
            {"entry": s.entry, "arrival_s": a, "after_kill": s.after_kill, "status": s.status, "ttft_s": x}
            for s, a, x in zip(replay.samples, arrivals, ttfts, strict=True)
        ],
    }
    if replay.kill:
        killed = replay.kill
        delta = _minus(replay.at_end.routes, replay.before_kill.routes)
        steady_ttfts: list[float | None] = _ttfts(baseline) if baseline is not None else [None] * len(ttfts)
        touched = [i for i in after if killed in (replay.requests[i].home, replay.requests[i].ingress)]
        hurt = [_hurt(ttfts[i], steady_ttfts[i], args.ttft_slo_s) for i in touched]
        row["failover"] = _phase(replay, after, ttfts, args.ttft_slo_s) | {
            "cross_region_share": cross_share(delta),
            "routes": _routes_record(delta),
            "killed": killed,
            "kill_at_s": kill_at,
            "lost_in_flight": len(lost),
            "entering_at_killed": sum(1 for i in after if replay.requests[i].ingress == killed),
            "touched_after_kill": len(touched),
            "touched_hurt": sum(hurt),
            "recovery_s": recovery_s(hurt, [arrivals[i] for i in touched], kill_at) if baseline else None,
            "no_kill": _phase(baseline, after, steady_ttfts, args.ttft_slo_s) if baseline else None,
        }
        if baseline is not None:
            row["no_kill_ttft_s"] = steady_ttfts  # by request, as "samples"
    return row


def _ttfts(replay: Replay) -> list[float | None]:
    """Trace seconds; None where the request did not complete."""
    t = replay.scaling.time
    return [(s.ttft_s + s.client_rtt_s) / t if s.status == 200 else None for s in replay.samples]


def _hurt(ttft: float | None, steady: float | None, slo_s: float) -> bool:
    """Failed or refused, or over the SLO where the run without the kill met it (as the sim)."""
    return ttft is None or (ttft > slo_s and steady is not None and steady <= slo_s)


_LOST = (CONNECTION_LOST, ERROR_EVENT, HUNG)


def _count(items) -> dict[str, int]:
    counts: dict[str, int] = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def _routes_record(routes: dict[str, dict[tuple[str, str], float]]) -> dict[str, dict[str, int]]:
    """ingress -> {"region/reason": count}"""
    return {ingress: {f"{r}/{why}": int(n) for (r, why), n in sorted(c.items()) if n} for ingress, c in routes.items()}


def _phase(replay: Replay, indices: list[int], ttfts: list[float | None], slo_s: float) -> dict:
    samples = [replay.samples[i] for i in indices]
    done = [replay.samples[i] for i in indices if replay.samples[i].status == 200]
    times = [t for i in indices if (t := ttfts[i]) is not None]
    good = sum(1 for t in times if t <= slo_s)
    arrivals = [replay.requests[i].request.arrival_s / replay.rate for i in indices]
    span = (max(arrivals) - min(arrivals)) if len(arrivals) > 1 else 0.0
    return {
        "requests": len(indices),
        "completed": len(done),
        "rejected": sum(s.status == 429 for s in samples),
        "errors": sum(s.status not in (200, 429) for s in samples),
        "cache_hit_ratio": sum(s.cached for s in done) / max(1, sum(s.prompt for s in done)),
        "ttft_p50_s": percentile(times, 50),
        "ttft_p90_s": percentile(times, 90),
        "goodput_share": good / len(indices) if indices else 0.0,
        "goodput_rps": good / span if span else 0.0,
        "by_ingress": {
            r: _ingress_share(replay, [i for i in indices if replay.requests[i].ingress == r], ttfts, slo_s)
            for r in replay.fleet.regions
        },
    }


def _ingress_share(replay: Replay, indices: list[int], ttfts: list[float | None], slo_s: float) -> dict:
    times = [t for i in indices if (t := ttfts[i]) is not None]
    return {
        "requests": len(indices),
        "ttft_p90_s": percentile(times, 90),
        "goodput_share": sum(1 for t in times if t <= slo_s) / len(indices) if indices else 0.0,
    }


def cross_share(routes: dict[str, dict[tuple[str, str], float]]) -> float | None:
    """Routes to another region / all routes; ``routes``: ingress -> its ``routes_from_metrics``."""
    total = sum(n for counts in routes.values() for n in counts.values())
    cross = sum(n for ingress, counts in routes.items() for (region, _), n in counts.items() if region != ingress)
    return cross / total if total else None


def _minus(end: dict[str, dict], start: dict[str, dict]) -> dict[str, dict]:
    return {
        ingress: {k: n - start.get(ingress, {}).get(k, 0.0) for k, n in counts.items()}
        for ingress, counts in end.items()
    }


def recovery_s(hurt: Sequence[bool], arrivals: Sequence[float], kill_at_s: float) -> float | None:
    """The simulated half's recovery time (module notes), over the live half's window."""
    return federation_sim.recovery_s(hurt, arrivals, kill_at_s, RECOVERY_WINDOW, RECOVERY_HURT_SHARE)


# --- report --------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _share(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def live_table(results: dict) -> str:
    """The live half's rows, as markdown (the doc's and the terminal's)."""
    s = results["settings"]
    lines = [
        f"Live: {s['requests']} requests, {s['regions']} each {s['fleet']['prefill']}P+{s['fleet']['decode']}D, "
        f"{s['kill']} killed at {s['kill_at_s']:.0f} s (trace); TTFT in trace ms; goodput: TTFT <= {s['ttft_slo_s']:g} s",
        "",
        "| phase | policy | requests | hit | TTFT p50 | TTFT p90 | goodput | good/s | 429 | errors | cross | recovery s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for phase in ("steady", "failover", "no kill"):
        for r in results["runs"]:
            f = r[phase] if phase != "no kill" else r["failover"].get("no_kill")
            if not f:
                continue
            recovery = "-"
            if phase == "failover":
                recovery = "never" if f["recovery_s"] is None else f"{f['recovery_s']:.0f}"
                recovery = recovery if s["baseline"] else "-"
            cross = _share(f.get("cross_region_share"))
            lines.append(
                f"| {phase} | {r['policy']} | {f['requests']} | {f['cache_hit_ratio']:.3f} | {_ms(f['ttft_p50_s'])} | "
                f"{_ms(f['ttft_p90_s'])} | {_share(f['goodput_share'])} | {f['goodput_rps']:.2f} | {f['rejected']} | "
                f"{f['errors']} | {cross} | {recovery} |"
            )
    regions = s["regions"]
    lines += [
        "",
        "Per entry region (steady): its clients' TTFT p90 (trace ms) and goodput",
        "",
        "| policy | " + " | ".join(f"{g} p90 | {g} good" for g in regions) + " |",
        "|---|" + "---|---|" * len(regions),
    ]
    for r in results["runs"]:
        cells = " | ".join(
            f"{_ms(r['steady']['by_ingress'][g]['ttft_p90_s'])} | {_share(r['steady']['by_ingress'][g]['goodput_share'])}"
            for g in regions
        )
        lines.append(f"| {r['policy']} | {cells} |")
    failed = [r for r in results["runs"] if r["failover"]]
    if failed:
        lines += ["", "After the kill:", ""]
        for r in failed:
            f = r["failover"]
            lines.append(
                f"- {r['policy']}: {f['lost_in_flight']} requests lost in flight on {f['killed']}'s ingress (in neither "
                f"phase); {f['entering_at_killed']} later ones of its clients sent to the nearest live ingress; "
                f"{f['touched_after_kill']} requests touched (client or home in {f['killed']}), "
                f"{f['touched_hurt']} hurt; {r['hung']} hung; statuses {r['statuses']}"
            )
    return "\n".join(lines)


def sim_table(results: dict) -> str:
    """The simulated half's rows, as markdown."""
    s = results["settings"]
    lines = [
        f"Simulated: {s['requests']} requests, {s['workers']} workers, {s['rate']:g}x the trace's rate, "
        f"{s['kill']} killed at {s['kill_at_share']:g} of the span; TTFT in ms; goodput: TTFT <= {s['ttft_slo_s']:g} s",
        "",
        "| run | policy | hit | TTFT p50 | TTFT p90 | TTFT p99 | good/s | goodput | rejected | failed | spills | cross | recovery s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run_name in ("steady", "failover"):
        for r in results[run_name]:
            recovery = "-"
            if "failover" in r:
                rec = r["failover"]["recovery_s"]
                recovery = "never" if rec is None else f"{rec:.1f}"
            lines.append(
                f"| {run_name} | {r['policy']} | {r['cache_hit_ratio']:.3f} | {_ms(r['ttft_p50_s'])} | "
                f"{_ms(r['ttft_p90_s'])} | {_ms(r['ttft_p99_s'])} | {r['goodput_rps']:.1f} | "
                f"{_share(r['goodput_share'])} | {r['rejected']} | {r['failed']} | {r['spills']} | "
                f"{_share(r['cross_region_share'])} | {recovery} |"
            )
    return "\n".join(lines)


def write_tables(out: Path) -> None:
    """``<out>/tables.md``: whichever halves ``out`` holds."""
    parts = []
    for half, render in (("sim", sim_table), ("live", live_table)):
        path = out / half / "results.json"
        if path.exists():
            parts.append(render(json.loads(path.read_text())))
    if parts:
        (out / "tables.md").write_text("\n\n".join(parts) + "\n")


def plot(results: dict, out: Path) -> None:
    slo = results["settings"]["ttft_slo_s"]
    fig, ax = plots.figure()
    for r in results["runs"]:
        for phase, style in (("steady", "-"), ("failover", "--")):
            samples = [
                x["ttft_s"]
                for x in r["samples"]
                if x["ttft_s"] is not None and x["after_kill"] == (phase == "failover")
            ]
            plots.cdf(ax, samples, f"{r['policy']} {phase}", style)
    ax.axvline(slo, color="k", linestyle=":", label="SLO")
    plots.save(
        fig,
        ax,
        out / "ttft_cdf.png",
        title="Live TTFT per region policy (before / after the kill)",
        xlabel="time to first token, trace seconds",
        ylabel="fraction of completed",
        log_x=True,
    )
    federation_sim.bars([r["steady"] | {"policy": r["policy"]} for r in results["runs"]], out / "goodput_hit.png")
    _timelines(results, out)


def _by_bucket(
    arrivals: list[float], ttfts: list[float | None], bucket: float
) -> tuple[list[float], list[list[float | None]]]:
    buckets: dict[int, list[float | None]] = {}
    for a, t in zip(arrivals, ttfts, strict=True):
        buckets.setdefault(int(a // bucket), []).append(t)
    keys = sorted(buckets)
    return [k * bucket for k in keys], [buckets[k] for k in keys]


def _timelines(results: dict, out: Path) -> None:
    """Per bucket of arrivals (one live second): requests meeting the SLO, and TTFT p50."""
    s = results["settings"]
    bucket = 1.0 / s["time_scale"]  # trace seconds per live second
    good_fig, good_ax = plots.figure()
    ttft_fig, ttft_ax = plots.figure()
    slo = s["ttft_slo_s"]
    for r in results["runs"]:
        arrivals = [x["arrival_s"] for x in r["samples"]]
        runs = [("", [x["ttft_s"] for x in r["samples"]], "-")]
        if r.get("no_kill_ttft_s"):
            runs.append((", no kill", r["no_kill_ttft_s"], "--"))
        color = None
        for suffix, ttfts, style in runs:
            xs, series = _by_bucket(arrivals, ttfts, bucket)
            label = r["policy"] + suffix
            good = [sum(1 for t in ts if t is not None and t <= slo) / bucket for ts in series]
            (line,) = good_ax.plot(xs, good, style, label=label, color=color)
            color = line.get_color()
            p50 = [percentile([t for t in ts if t is not None], 50) or math.nan for ts in series]
            ttft_ax.plot(xs, p50, style, label=label, color=color)
    for ax in (good_ax, ttft_ax):
        if s["kill"]:
            ax.axvline(s["kill_at_s"], color="k", linestyle=":", label=f"{s['kill']} killed")
    plots.save(
        good_fig,
        good_ax,
        out / "timeline_good.png",
        title="Requests meeting the TTFT SLO, by arrival",
        xlabel="arrival, trace seconds",
        ylabel="per trace second",
    )
    plots.save(
        ttft_fig,
        ttft_ax,
        out / "timeline_ttft.png",
        title="TTFT p50 by arrival",
        xlabel="arrival, trace seconds",
        ylabel="trace seconds",
        log_y=True,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m switchyard.bench.federation", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "LiveRegions",
    "Replay",
    "add_arguments",
    "cross_share",
    "recovery_s",
    "routes_from_metrics",
    "run",
    "run_live",
    "summarize",
    "write_tables",
]
