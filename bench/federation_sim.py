"""The simulated half of ``switchyard bench federation``: regions in virtual time.

    python -m switchyard.bench.federation_sim --out bench/results/federation-sim

Three regions, each the **real** ``SchedulerCore`` over its own simulated fleet (``bench.replay``
and ``bench.fleet``, the calibrated H100 cost model of ``bench.costmodel``), joined by round
trips (us-eu 30 ms, us-ap 70 ms, eu-ap 140 ms by default). Every ingress routes with the real
``scheduler.regions.RegionRouter``; one run per region policy (``local``, ``blind``, ``geo``) on
the same trace, and the same run again with one region killed halfway.

The trace (``split_by_region``, which the live half reuses): the Mooncake conversation trace,
whose prompts all start with one shared block (id 0, a system prompt) and whose conversations
resend their history, so a **session** is the requests that share their second block. Each
session gets a home region, drawn with ``--weights`` (0.6/0.25/0.15: the first region is
overloaded); its first turn enters at home, each later turn enters at another region with
probability ``--travel-share`` (a traveller, a mobile client). Draws are seeded per session and
per turn, so a slice of the trace splits as the whole does.

What crosses regions, in virtual time:

- **Summaries**: every ``--summary-interval-s`` each live region's core says
  ``region_summary``; every ingress hears it half a round trip later (its own at once), and its
  router learns the round trip (``measured``) with it.
- **Requests**: routed at the ingress; one sent to another region reaches its core half a round
  trip later, and its first token comes back half a round trip after it is made: a cross-region
  request pays the round trip on its TTFT. A core's 429 comes back the same way, and the ingress
  routes again with that region excluded (``local`` then has nowhere else: the 429 stands).
- **The session directory**: session -> (region that admitted its last turn, that prompt's
  length), written at admission and read by every ingress at once (the live half replicates it
  through JetStream; the replication lag is not simulated).

**Failover** (``--kill``, ``--kill-at``): at that share of the trace's span the region's
scheduler, workers and ingress stop. What it had in flight fails; no more summaries come from it,
so each router drops it ``dark_after_s`` after its last one; until then a request sent there gets
no responders after the round trip and is routed again without it. Its clients turn to the
nearest live region's ingress, paying that round trip themselves.

**Recovery time.** The requests the kill *touches* are those arriving after it whose client or
whose session (in the directory) was in the killed region. One of them is *hurt* when it failed
or was refused, or missed the TTFT SLO that it met in the steady run of the same policy (the same
request without the kill: the trace's own slow requests, long prompts over the SLO anyway, do not
count). Over the touched requests in arrival order, a window of ``RECOVERY_WINDOW`` consecutive
ones is *bad* when more than ``RECOVERY_HURT_SHARE`` of it is hurt. Recovery time: from the kill
to the arrival of the last request of the last bad window (0 when no window is bad); ``null``
("never") when the trace's last window is still bad: the survivors never absorbed the load.

Figures per policy: cache hit ratio (prompt tokens found in a prefix cache / prompt tokens of
the requests prefilled), TTFT p50/p90/p99 at the client (round trips included), goodput
(requests whose TTFT met ``--ttft-slo-s``; rejected and failed ones miss it; per second of
trace and as a share), spills, cross-region share (requests served outside their ingress's
region), and the router's decisions per second (wall clock inside ``RegionRouter.route``).
Virtual-time figures are deterministic; wall-clock ones are under ``timing``.

Writes ``results.json``, ``ttft_cdf.png`` (steady run), ``ttft_cdf_failover.png``,
``goodput_hit.png`` into ``--out`` and prints the tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from switchyard.bench import plots
from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import TICK, EventLoop, FleetShape, SimWorker
from switchyard.bench.replay import MODEL, TENANT, Outcomes, Replay, ReplaySettings
from switchyard.bench.stats import percentile
from switchyard.bench.traces import (
    TRACE_BLOCK_SIZE,
    TraceRequest,
    block_keys,
    hit_ratio_bound,
    read_trace,
    tenant_salt,
)
from switchyard.scheduler import REGION_POLICIES, RegionPolicy, RegionRouter, SchedulerConfig
from switchyard.schemas import KvEventBatch, Rejected, RequestSpec, SamplingParams, SessionPlacement, WorkerEvent

DEFAULT_TRACE = Path("/work/shared/data/traces/mooncake_conversation_trace.jsonl")
DEFAULT_REGIONS = "us,eu,ap"
DEFAULT_RTTS = "us-eu=0.030,us-ap=0.070,eu-ap=0.140"
RECOVERY_WINDOW = 100  # consecutive touched requests (module notes: recovery time)
RECOVERY_HURT_SHARE = 0.1  # a window with more of them hurt is bad
SESSION_TTL_S = 600.0
_SALT = tenant_salt(TENANT)


# --- the trace, split by session across regions ---------------------------------------------------


@dataclass(frozen=True, slots=True)
class FederatedRequest:
    request: TraceRequest
    session: int  # the second block id of its prompt (a one-block prompt: a session of its own)
    turn: int  # 0 for the session's first request
    home: str  # the session's home region
    ingress: str  # where this request enters: home, or elsewhere for a traveller's later turn


def session_of(request: TraceRequest, index: int) -> int:
    """Requests sharing their second block are one conversation (block 0 is everyone's)."""
    return request.block_ids[1] if len(request.block_ids) > 1 else -1 - index


def split_by_region(
    trace: Sequence[TraceRequest],
    regions: Sequence[str],
    weights: Sequence[float],
    travel_share: float,
    seed: int,
) -> list[FederatedRequest]:
    """Each session a home drawn by ``weights``; a later turn enters elsewhere with
    probability ``travel_share``. Draws depend on (seed, session, turn) only."""
    if len(regions) != len(weights) or not regions:
        raise ValueError(f"{len(regions)} regions but {len(weights)} weights")
    if not 0.0 <= travel_share <= 1.0:
        raise ValueError(f"travel share must be within 0..1, got {travel_share}")
    homes: dict[int, str] = {}
    turns: dict[int, int] = {}
    split = []
    for i, request in enumerate(trace):
        session = session_of(request, i)
        if session not in homes:
            homes[session] = random.Random(f"{seed}/{session}").choices(list(regions), weights)[0]
        turn = turns.get(session, 0)
        turns[session] = turn + 1
        ingress = homes[session]
        draw = random.Random(f"{seed}/{session}/{turn}")
        if turn > 0 and len(regions) > 1 and draw.random() < travel_share:
            ingress = draw.choice([r for r in regions if r != ingress])
        split.append(FederatedRequest(request, session, turn, homes[session], ingress))
    return split


# --- settings -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FederationSettings:
    regions: tuple[str, ...]
    rtt_s: dict[tuple[str, str], float]  # both orders
    shapes: dict[str, FleetShape]
    cost: CostModel = CostModel()
    time_scale: float = 1.0 / 50
    summary_interval_s: float = 0.5
    dark_after_s: float = 3.0
    ttft_slo_s: float = 2.0
    max_queued_tokens: int = SchedulerConfig().max_queued_tokens
    kill: str | None = None
    kill_at_s: float = 0.0  # virtual seconds
    seed: int = 0

    def rtt(self, a: str, b: str) -> float:
        return 0.0 if a == b else self.rtt_s[(a, b)]

    def nearest(self, region: str, alive: Callable[[str], bool]) -> str:
        others = [r for r in self.regions if r != region and alive(r)]
        return min(others, key=lambda r: (self.rtt(region, r), r))


def parse_rtts(text: str, regions: Sequence[str]) -> dict[tuple[str, str], float]:
    """``a-b=seconds,...``: every pair of ``regions`` once."""
    rtts: dict[tuple[str, str], float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        pair, _, value = item.partition("=")
        a, _, b = pair.partition("-")
        if a not in regions or b not in regions or a == b or not value:
            raise ValueError(f"round trip {item!r}: want a-b=seconds for two of {', '.join(regions)}")
        rtts[(a, b)] = rtts[(b, a)] = float(value)
    pairs = [(a, b) for k, a in enumerate(regions) for b in regions[k + 1 :]]
    missing = [f"{a}-{b}" for a, b in pairs if (a, b) not in rtts]
    if missing:
        raise ValueError(f"no round trip for {', '.join(missing)}")
    return rtts


def fleet_shapes(
    regions: Sequence[str],
    workers: int,
    prefill_share: float,
    weights: Sequence[float] | None = None,
    **shape,
) -> dict[str, FleetShape]:
    """``workers`` split by ``weights`` (default: evenly), the remainder to the first regions;
    in each region ``prefill_share`` of them prefill (at least one of each role)."""
    weights = list(weights) if weights is not None else [1.0] * len(regions)
    if len(weights) != len(regions):
        raise ValueError(f"{len(regions)} regions but {len(weights)} fleet weights")
    counts = [int(workers * w / sum(weights)) for w in weights]
    for k in range(workers - sum(counts)):
        counts[k % len(regions)] += 1
    shapes = {}
    for region, n in zip(regions, counts, strict=True):
        if n < 2:
            raise ValueError(f"region {region}: {n} workers, want at least a prefill and a decode one")
        prefill = min(n - 1, max(1, round(n * prefill_share)))
        shapes[region] = FleetShape(prefill, n - prefill, **shape)
    return shapes


# --- one region: the real core over its simulated fleet ----------------------------------------------


class RegionSim(Replay):
    """``bench.replay``'s loop for one region, on the federation's clock and outcomes.

    The federation submits (``admit``); what the core and the workers do after is
    ``Replay``'s own. A killed region ignores its workers from then on."""

    def __init__(self, name: str, settings: ReplaySettings, loop: EventLoop, outcomes: Outcomes) -> None:
        super().__init__([], settings)
        self.name, self.loop, self.outcomes = name, loop, outcomes
        # Replay made its workers on a clock of its own: these run on the federation's.
        self.workers = {
            wid: SimWorker(wid, role, settings.cost, settings.shape.cache_blocks, loop, self)
            for wid, role in settings.shape.roles.items()
        }
        self.dead = False
        self.summaries = 0
        self.inflight: set[int] = set()

    def start(self) -> None:
        self._register()

    def admit(self, spec: RequestSpec, now: float) -> Rejected | None:
        reply, actions = self._call(self.core.submit, spec, now)
        if isinstance(reply, Rejected):
            self.timing.decisions += 1
            self.timing.rejections[reply.reason] = self.timing.rejections.get(reply.reason, 0) + 1
            return reply
        self._outstanding += 1
        self.inflight.add(int(spec.request_id))
        self._carry_out(actions, now)
        return None

    def summary(self, now: float):
        self.summaries += 1
        return self.core.region_summary(self.name, f"{self.name}-scheduler", self.summaries, now)

    def tick(self, now: float) -> None:
        if not self.dead:
            self._carry_out(self._call(self.core.tick, now), now)

    def kill(self) -> list[int]:
        """Everything stops; returns the requests it had in flight (now failed)."""
        self.dead = True
        lost = sorted(i for i in self.inflight if self.outcomes.status[i] == "pending")
        for i in lost:
            self._settle(i, "failed")
        return lost

    def worker_event(self, event: WorkerEvent, now: float) -> None:
        if not self.dead:
            super().worker_event(event, now)

    def kv_events(self, batch: KvEventBatch, now: float) -> None:
        if not self.dead:
            super().kv_events(batch, now)

    def _settle(self, i: int, status: str) -> None:
        self.inflight.discard(i)
        super()._settle(i, status)


# --- the federation: ingresses, routers, directory, clock ----------------------------------------------


@dataclass
class RouterTiming:
    calls: int = 0
    wall_s: float = 0.0


@dataclass
class Ledger:
    """Per request of the trace, by index."""

    served_in: list[str]
    entered_at: list[str]  # the ingress that routed it (its client's, or the nearest live one)
    back_s: list[float]  # from its first token in the serving region to its client
    reasons: list[str]  # the route that placed it (its last one, after any retries)
    touched_killed: list[bool]  # after the kill: its client or its session was in the killed region
    routes: int = 0
    retries: int = 0

    @classmethod
    def empty(cls, n: int) -> Ledger:
        return cls([""] * n, [""] * n, [0.0] * n, [""] * n, [False] * n)


class FederationSim:
    def __init__(self, requests: Sequence[FederatedRequest], settings: FederationSettings, policy: RegionPolicy):
        self.requests, self.settings, self.policy = requests, settings, policy
        self.loop = EventLoop()
        self.outcomes = Outcomes.empty(len(requests))
        self.ledger = Ledger.empty(len(requests))
        self.router_timing = RouterTiming()
        self.regions = {
            name: RegionSim(name, self._replay_settings(name), self.loop, self.outcomes) for name in settings.regions
        }
        self.routers = {
            name: RegionRouter(name, policy=policy, dark_after_s=settings.dark_after_s) for name in settings.regions
        }
        self.directory: dict[int, SessionPlacement] = {}
        self.lost_in_flight: list[int] = []
        self._salt_keys: dict[int, list[int]] = {}
        self._arrived = 0

    def _replay_settings(self, region: str) -> ReplaySettings:
        s = self.settings
        return ReplaySettings(
            policy="switchyard",
            shape=s.shapes[region],
            cost=s.cost,
            max_queued_tokens=s.max_queued_tokens,
            seed=s.seed,
            time_scale=s.time_scale,
        )

    def run(self) -> FederationSim:
        for region in self.regions.values():
            region.start()
        for i, fr in enumerate(self.requests):
            self.loop.at(fr.request.arrival_s * self.settings.time_scale, partial(self._enter, i))
        self.loop.at(0.0, self._publish, TICK)
        self.loop.at(0.0, self._tick, TICK)
        if self.settings.kill is not None:
            self.loop.at(self.settings.kill_at_s, self._kill)
        self.loop.run()
        return self

    def _busy(self) -> bool:
        return self._arrived < len(self.requests) or any(r._outstanding for r in self.regions.values())

    # --- clocks: summaries, ticks, the kill ---------------------------------------------------------

    def _publish(self, now: float) -> None:
        for name, region in self.regions.items():
            if region.dead:
                continue
            summary = region.summary(now)
            for listener in self.settings.regions:
                rtt = self.settings.rtt(name, listener)
                self.loop.at(now + rtt / 2, partial(self._hear, listener, summary, name, rtt))
        if self._busy():
            self.loop.at(now + self.settings.summary_interval_s, self._publish, TICK)

    def _hear(self, listener: str, summary, name: str, rtt: float, now: float) -> None:
        router = self.routers[listener]
        router.observe(summary, now)
        router.measured(name, rtt)

    def _tick(self, now: float) -> None:
        for region in self.regions.values():
            region.tick(now)
        if self._busy():
            self.loop.at(now + 1.0, self._tick, TICK)

    def _kill(self, now: float) -> None:
        assert self.settings.kill is not None
        self.lost_in_flight = self.regions[self.settings.kill].kill()

    # --- a request's way -------------------------------------------------------------------------

    def _enter(self, i: int, now: float) -> None:
        self._arrived += 1
        fr, s = self.requests[i], self.settings
        ingress = fr.ingress
        if self.regions[ingress].dead:  # its client turns to the nearest live ingress
            ingress = s.nearest(ingress, lambda r: not self.regions[r].dead)
        self.ledger.entered_at[i] = ingress
        if s.kill is not None and now >= s.kill_at_s:
            placement = self.directory.get(fr.session)
            self.ledger.touched_killed[i] = fr.ingress == s.kill or (
                placement is not None and placement.region == s.kill
            )
        self._route(i, frozenset(), now)

    def _route(self, i: int, exclude: frozenset[str], now: float) -> None:
        fr, ingress = self.requests[i], self.ledger.entered_at[i]
        placement = self.directory.get(fr.session)
        if placement is not None and placement.expires_at <= now:
            placement = None
        # No collection of the simulation's heap starts inside the timed call (it would be
        # charged to the router); collections run, as they would have, right after it.
        collecting = gc.isenabled()
        gc.disable()
        started = time.perf_counter()
        route = self.routers[ingress].route(fr.request.input_tokens, placement, now, exclude)
        self.router_timing.wall_s += time.perf_counter() - started
        if collecting:
            gc.enable()
        self.router_timing.calls += 1
        self.ledger.routes += 1
        if route.region in exclude:  # every region refused it (local: its home did)
            self._settle_unplaced(i, "rejected")
            return
        self.ledger.reasons[i] = route.reason
        delay = self.settings.rtt(ingress, route.region) / 2
        self.loop.at(now + delay, partial(self._submit, i, route.region, exclude))

    def _submit(self, i: int, region: str, exclude: frozenset[str], now: float) -> None:
        ingress = self.ledger.entered_at[i]
        back = self.settings.rtt(ingress, region) / 2
        target = self.regions[region]
        refused = True if target.dead else target.admit(self._spec(i, ingress), now) is not None
        if refused:  # no responders, or a 429: the ingress hears it a half round trip later
            self.ledger.retries += 1
            self.loop.at(now + back, partial(self._route, i, exclude | {region}))
            return
        fr = self.requests[i]
        client = self.settings.rtt(fr.ingress, ingress)  # a client that had to turn elsewhere
        self.ledger.served_in[i], self.ledger.back_s[i] = region, back + client
        self.directory[fr.session] = SessionPlacement(
            region=region, prompt_tokens=fr.request.input_tokens, at=now, expires_at=now + SESSION_TTL_S
        )

    def _settle_unplaced(self, i: int, status: str) -> None:
        if self.outcomes.status[i] == "pending":
            self.outcomes.status[i] = status

    def _spec(self, i: int, ingress: str) -> RequestSpec:
        request = self.requests[i].request
        keys = self._salt_keys.get(i)
        if keys is None:
            keys = self._salt_keys[i] = block_keys(request.block_ids, _SALT)
        return RequestSpec(
            request_id=str(i),
            ingress_id=ingress,
            model=MODEL,
            prompt_tokens=[0] * request.input_tokens,
            block_size=TRACE_BLOCK_SIZE,
            block_keys=keys,
            sampling=SamplingParams(max_tokens=request.output_tokens, temperature=0.0),
            tenant=TENANT,
        )


# --- figures -------------------------------------------------------------------------------------------


def ttfts_of(sim: FederationSim) -> list[float | None]:
    """Per request: first token at its client - its arrival; None if it never had one."""
    out, scale = sim.outcomes, sim.settings.time_scale
    return [
        out.first_token[i] + sim.ledger.back_s[i] - fr.request.arrival_s * scale
        if out.status[i] == "done" and out.first_token[i] >= 0
        else None
        for i, fr in enumerate(sim.requests)
    ]


def summarize(sim: FederationSim, bound: float, wall_s: float, baseline: list[float | None] | None = None) -> dict:
    """The figures of one run; ``baseline``: the TTFTs of the same policy's steady run (the
    failover run's recovery time is measured against it)."""
    s, out, ledger = sim.settings, sim.outcomes, sim.ledger
    ttfts = ttfts_of(sim)
    done = [t for t in ttfts if t is not None]
    good = sum(1 for t in done if t <= s.ttft_slo_s)
    prefilled = [i for i in range(len(sim.requests)) if out.first_token[i] >= 0]
    prompt = sum(sim.requests[i].request.input_tokens for i in prefilled)
    cached = sum(out.cached[i] for i in prefilled)
    served = [i for i, r in enumerate(ledger.served_in) if r]
    arrivals = [fr.request.arrival_s * s.time_scale for fr in sim.requests]
    span = (max(arrivals) - min(arrivals)) or 1.0
    reasons: dict[str, int] = {}
    for i in served:
        reasons[ledger.reasons[i]] = reasons.get(ledger.reasons[i], 0) + 1
    figures = {
        "policy": sim.policy,
        "requests": len(sim.requests),
        "completed": out.status.count("done"),
        "rejected": out.status.count("rejected"),
        "failed": out.status.count("failed"),
        "unfinished": out.status.count("pending"),
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "hit_ratio_bound": bound,
        "ttft_p50_s": percentile(done, 50),
        "ttft_p90_s": percentile(done, 90),
        "ttft_p99_s": percentile(done, 99),
        "goodput_rps": good / span,
        "goodput_share": good / len(sim.requests),
        "spills": reasons.get("spill", 0),
        "cross_region_share": sum(1 for i in served if ledger.served_in[i] != ledger.entered_at[i]) / len(served)
        if served
        else 0.0,
        "route_reasons": dict(sorted(reasons.items())),
        "served_by_region": {r: sum(1 for i in served if ledger.served_in[i] == r) for r in s.regions},
        "by_ingress": {r: _ingress_figures(sim, ttfts, r) for r in s.regions},
        "prefill_utilisation": {r: _prefill_utilisation(sim.regions[r], span) for r in s.regions},
        "routes": ledger.routes,
        "retries": ledger.retries,
        "trace_span_s": span,
        "makespan_s": sim.loop.now,
        "timing": {
            "wall_s": wall_s,
            "router_decisions": sim.router_timing.calls,
            "router_wall_s": sim.router_timing.wall_s,
            "router_decisions_per_s": sim.router_timing.calls / sim.router_timing.wall_s
            if sim.router_timing.wall_s
            else None,
            "core_decisions_per_s": {
                name: r.timing.decisions / r.timing.wall_s if r.timing.wall_s else None
                for name, r in sim.regions.items()
            },
        },
        "ttft_samples_s": done,
    }
    if s.kill is not None:
        figures["failover"] = failover_figures(sim, ttfts, baseline or ttfts)
    return figures


def _prefill_utilisation(region: RegionSim, span_s: float) -> float:
    """The share of the trace's span its prefill workers spent iterating, on average."""
    prefill = [w for w in region.workers.values() if w.role != "decode"]
    return sum(w.stats.busy_s for w in prefill) / (len(prefill) * span_s) if prefill else 0.0


def _ingress_figures(sim: FederationSim, ttfts: list[float | None], region: str) -> dict:
    """The requests whose client is in ``region`` (its ingress, before any kill)."""
    mine = [i for i, fr in enumerate(sim.requests) if fr.ingress == region]
    done = [t for i in mine if (t := ttfts[i]) is not None]
    good = sum(1 for t in done if t <= sim.settings.ttft_slo_s)
    return {
        "requests": len(mine),
        "ttft_p50_s": percentile(done, 50),
        "ttft_p90_s": percentile(done, 90),
        "goodput_share": good / len(mine) if mine else 0.0,
    }


def failover_figures(sim: FederationSim, ttfts: list[float | None], baseline: list[float | None]) -> dict:
    s = sim.settings
    touched = [i for i in range(len(sim.requests)) if sim.ledger.touched_killed[i]]
    hurt = [_hurt(ttfts[i], baseline[i], s.ttft_slo_s) for i in touched]
    arrivals = [sim.requests[i].request.arrival_s * s.time_scale for i in touched]
    return {
        "killed": s.kill,
        "kill_at_s": s.kill_at_s,
        "failed_in_flight": len(sim.lost_in_flight),
        "touched_after_kill": len(touched),
        "touched_hurt": sum(hurt),
        "touched_ttft_p90_s": percentile([t for i in touched if (t := ttfts[i]) is not None], 90),
        "recovery_window": RECOVERY_WINDOW,
        "recovery_hurt_share": RECOVERY_HURT_SHARE,
        "recovery_s": recovery_s(hurt, arrivals, s.kill_at_s),
    }


def _hurt(ttft: float | None, steady: float | None, slo_s: float) -> bool:
    """Failed or refused, or over the SLO where the steady run met it."""
    return ttft is None or (ttft > slo_s and steady is not None and steady <= slo_s)


def recovery_s(
    hurt: Sequence[bool],
    arrivals: Sequence[float],
    kill_at_s: float,
    window: int = RECOVERY_WINDOW,
    hurt_share: float = RECOVERY_HURT_SHARE,
) -> float | None:
    """From the kill to the last request of the last bad window (module notes); None: never.
    The live half uses it too, with its own (smaller) window."""
    if len(hurt) < window:
        return None
    bad = int(hurt_share * window)
    count = sum(hurt[:window])
    last_bad = window - 1 if count > bad else None
    for end in range(window, len(hurt)):
        count += hurt[end] - hurt[end - window]
        if count > bad:
            last_bad = end
    if last_bad is None:
        return 0.0
    if last_bad == len(hurt) - 1:
        return None
    return arrivals[last_bad] - kill_at_s


# --- the run -----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake JSONL trace")
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--regions", default=DEFAULT_REGIONS, help="comma-separated region names")
    p.add_argument("--weights", default="0.6,0.25,0.15", help="share of sessions at home in each region")
    p.add_argument("--travel-share", type=float, default=0.2, help="later turns entering at another region")
    p.add_argument("--rtts", default=DEFAULT_RTTS, help="round trips, a-b=seconds,...")
    p.add_argument("--workers", type=int, default=512, help="simulated workers in all regions together")
    p.add_argument("--fleet-weights", default="", help="share of the workers in each region (default: even)")
    p.add_argument("--prefill-share", type=float, default=0.75, help="of each region's workers, prefill")
    p.add_argument(
        "--cache-blocks",
        type=int,
        default=CostModel().kv_capacity_tokens // TRACE_BLOCK_SIZE,
        help="prefix cache per worker, in 512-token blocks (default: its HBM KV capacity)",
    )
    p.add_argument("--rate", type=float, default=50.0, help="times the trace's arrival rate")
    p.add_argument("--policies", default=",".join(REGION_POLICIES), help="region policies, side by side")
    p.add_argument("--ttft-slo-s", type=float, default=2.0, help="goodput: TTFT at the client at most this")
    p.add_argument("--summary-interval-s", type=float, default=0.5)
    p.add_argument("--dark-after-s", type=float, default=3.0)
    p.add_argument("--kill", default="eu", help="the region killed in the failover run ('' for no such run)")
    p.add_argument("--kill-at", type=float, default=0.5, help="when, as a share of the trace's span")
    p.add_argument("--seed", type=int, default=0, help="the trace split's draws")
    p.add_argument("--out", type=Path, default=Path("bench/results/federation-sim"), help="results folder")
    p.add_argument("--no-plots", action="store_true", help="skip the PNGs")


def settings_from(args: argparse.Namespace, span_s: float) -> FederationSettings:
    regions = tuple(r.strip() for r in args.regions.split(",") if r.strip())
    if args.rate <= 0:
        raise ValueError("--rate must be positive")
    if args.kill and args.kill not in regions:
        raise ValueError(f"--kill {args.kill!r}: not one of {', '.join(regions)}")
    scale = 1.0 / args.rate
    return FederationSettings(
        regions=regions,
        rtt_s=parse_rtts(args.rtts, regions),
        shapes=fleet_shapes(
            regions,
            args.workers,
            args.prefill_share,
            [float(w) for w in args.fleet_weights.split(",")] if args.fleet_weights else None,
            cache_blocks=args.cache_blocks,
        ),
        time_scale=scale,
        summary_interval_s=args.summary_interval_s,
        dark_after_s=args.dark_after_s,
        ttft_slo_s=args.ttft_slo_s,
        kill=args.kill or None,
        kill_at_s=args.kill_at * span_s * scale,
        seed=args.seed,
    )


def run_sim(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict:
    """Both runs (steady, then with the kill) of every policy; writes ``--out``; the results."""
    policies = parse_policies(args.policies)
    trace = read_trace(args.trace, "mooncake", args.limit)
    regions = [r.strip() for r in args.regions.split(",") if r.strip()]
    weights = [float(w) for w in args.weights.split(",")]
    split = split_by_region(trace, regions, weights, args.travel_share, args.seed)
    span = trace[-1].arrival_s - trace[0].arrival_s
    failover = settings_from(args, span)
    steady = dataclasses.replace(failover, kill=None)
    bound = hit_ratio_bound(trace)
    log(describe(split, steady, bound))
    results: dict = {"settings": settings_record(args, steady, split), "steady": [], "failover": []}
    baselines: dict[str, list[float | None]] = {}
    for name, settings in (("steady", steady), ("failover", failover)):
        if name == "failover" and settings.kill is None:
            continue
        for policy in policies:
            started = time.perf_counter()
            sim = FederationSim(split, settings, policy).run()
            wall = time.perf_counter() - started
            results[name].append(summarize(sim, bound, wall, baselines.get(policy)))
            baselines.setdefault(policy, ttfts_of(sim))
            log(f"  {name} {policy}: {time.perf_counter() - started:.1f} s wall, {sim.loop.processed} events")
    write(results, args.out, plots_too=not args.no_plots)
    log(table(results))
    return results


def parse_policies(text: str) -> list[RegionPolicy]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in REGION_POLICIES]
    if not names or unknown:
        raise ValueError(f"--policies: choose from {', '.join(REGION_POLICIES)}, got {text!r}")
    return names  # type: ignore[return-value]


def describe(split: list[FederatedRequest], s: FederationSettings, bound: float) -> str:
    sessions = len({fr.session for fr in split})
    travelling = sum(1 for fr in split if fr.ingress != fr.home)
    homes = {r: sum(1 for fr in split if fr.ingress == r) for r in s.regions}
    fleets = ", ".join(f"{r}: {sh.prefill}P+{sh.decode}D" for r, sh in s.shapes.items())
    return (
        f"{len(split)} requests in {sessions} sessions, {travelling} entering away from home; "
        f"by ingress {homes}; fleets {fleets}; {1 / s.time_scale:g}x the trace's rate; "
        f"hit ratio bound {bound:.3f}"
    )


def settings_record(args: argparse.Namespace, s: FederationSettings, split: list[FederatedRequest]) -> dict:
    return {
        "trace": args.trace.name,
        "requests": len(split),
        "sessions": len({fr.session for fr in split}),
        "regions": list(s.regions),
        "weights": [float(w) for w in args.weights.split(",")],
        "travel_share": args.travel_share,
        "rtt_s": {f"{a}-{b}": v for (a, b), v in s.rtt_s.items() if a < b},
        "fleet_weights": args.fleet_weights or None,
        "fleets": {
            r: {"prefill": sh.prefill, "decode": sh.decode, "cache_blocks": sh.cache_blocks}
            for r, sh in s.shapes.items()
        },
        "workers": sum(sh.prefill + sh.decode for sh in s.shapes.values()),
        "rate": 1 / s.time_scale,
        "summary_interval_s": s.summary_interval_s,
        "dark_after_s": s.dark_after_s,
        "ttft_slo_s": s.ttft_slo_s,
        "kill": args.kill or None,
        "kill_at_share": args.kill_at,
        "seed": s.seed,
    }


def write(results: dict, out: Path, plots_too: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    public = {
        k: [{f: v for f, v in r.items() if not f.endswith("_samples_s")} for r in rs] if isinstance(rs, list) else rs
        for k, rs in results.items()
    }
    (out / "results.json").write_text(json.dumps(public, indent=2) + "\n")
    if plots_too:
        plot(results, out)


def table(results: dict) -> str:
    def ms(x: float | None) -> str:
        return f"{x * 1e3:>8.0f}" if x is not None else f"{'-':>8}"

    slo = results["settings"]["ttft_slo_s"]
    lines = [
        "",
        f"TTFT at the client in ms (round trips included); goodput: requests with TTFT <= {slo:g} s "
        "(rejected and failed miss it); cross: served outside their ingress's region; dec/s: RegionRouter.route",
        f"{'run':<9}{'policy':<7}{'hit':>6}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'good/s':>8}{'good%':>7}"
        f"{'rej':>6}{'fail':>6}{'spills':>7}{'cross':>7}{'dec/s':>9}{'recovery s':>11}",
    ]
    for run in ("steady", "failover"):
        for r in results[run]:
            rate = r["timing"]["router_decisions_per_s"]
            recovery = "-"
            if "failover" in r:
                rec = r["failover"]["recovery_s"]
                recovery = "never" if rec is None else f"{rec:.1f}"
            lines.append(
                f"{run:<9}{r['policy']:<7}{r['cache_hit_ratio']:>6.3f}{ms(r['ttft_p50_s']):>9}{ms(r['ttft_p90_s'])}"
                f"{ms(r['ttft_p99_s'])}{r['goodput_rps']:>8.1f}{100 * r['goodput_share']:>6.1f}%"
                f"{r['rejected']:>6}{r['failed']:>6}{r['spills']:>7}{100 * r['cross_region_share']:>6.1f}%"
                f"{rate or 0:>9.0f}{recovery:>11}"
            )
    return "\n".join(lines + region_table(results))


def region_table(results: dict) -> list[str]:
    """Per region: its clients' TTFT p90 and goodput, and its prefill fleet's utilisation."""
    regions = results["settings"]["regions"]
    head = "".join(f"{r + ' p90':>9}{'good%':>7}{'busy':>6}" for r in regions)
    lines = [
        "",
        "per region: its clients' TTFT p90 (ms) and goodput; busy: its prefill workers' utilisation",
        f"{'run':<9}{'policy':<7}{head}",
    ]
    for run in ("steady", "failover"):
        for r in results[run]:
            cells = "".join(
                f"{1e3 * (r['by_ingress'][g]['ttft_p90_s'] or 0):>9.0f}{100 * r['by_ingress'][g]['goodput_share']:>6.1f}%"
                f"{r['prefill_utilisation'][g]:>6.2f}"
                for g in regions
            )
            lines.append(f"{run:<9}{r['policy']:<7}{cells}")
    return lines


def plot(results: dict, out: Path) -> None:
    slo = results["settings"]["ttft_slo_s"]
    for run, name in (("steady", "ttft_cdf.png"), ("failover", "ttft_cdf_failover.png")):
        if not results[run]:
            continue
        fig, ax = plots.figure()
        for r in results[run]:
            plots.cdf(ax, r["ttft_samples_s"], r["policy"])
        ax.axvline(slo, color="k", linestyle=":", label="SLO")
        title = "TTFT per region policy" + (" (one region killed halfway)" if run == "failover" else "")
        plots.save(fig, ax, out / name, title=title, xlabel="seconds", ylabel="fraction of completed", log_x=True)
    bars(results["steady"], out / "goodput_hit.png")


def bars(rows: list[dict], path: Path) -> None:
    fig, ax = plots.figure()
    names = [r["policy"] for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["goodput_share"] for r in rows], 0.4, label="goodput (share within SLO)")
    ax.bar([x + 0.2 for x in xs], [r["cache_hit_ratio"] for r in rows], 0.4, label="cache hit ratio")
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, 1)
    plots.save(fig, ax, path, title="Goodput and cache hit ratio per region policy", xlabel="policy", ylabel="ratio")


def run(args: argparse.Namespace) -> int:
    run_sim(args)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m switchyard.bench.federation_sim", description=__doc__.split("\n")[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "FederatedRequest",
    "FederationSettings",
    "FederationSim",
    "RegionSim",
    "add_arguments",
    "fleet_shapes",
    "parse_rtts",
    "region_table",
    "run",
    "run_sim",
    "session_of",
    "split_by_region",
    "summarize",
    "table",
]
