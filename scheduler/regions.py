"""Which region serves a request: the pure decision of a federated ingress.

Every region's active scheduler publishes a ``RegionSummary`` (its predicted queue time,
its prefill rate, whether it is saturated); every ingress hears all of them, measures its
round trip to each region, and routes each request it admits with ``RegionRouter.route``:

- ``geo`` (the default): a request whose session the directory places in another region
  goes there when that region's predicted time to first token (its queue, the prompt
  minus the prefix it holds, the round trip) beats recomputing the prompt at home; a
  request with no binding stays home unless home is saturated (its summary says so, what
  this router sent it since would queue it past its threshold, or another region would
  serve it ``spill_margin_s`` sooner), and then spills to the region with the lowest
  predicted TTFT plus round trip that is not saturated itself
  (every region saturated: the lowest of them all, home winning ties). A bound session
  whose home recompute wins but whose home is saturated spills the same way.
- ``local``: always home (region-local only; the baseline without federation).
- ``blind``: the region with the least predicted queue, whatever the session or the
  round trip (a global least-loaded balancer, region-blind).

A region that has published no summary for ``dark_after_s`` is dark: no policy sends
it work, and the ingress fails what it has in flight there (``RegionRouter.dark``). Between
two summaries of a region, what this router sent it counts as queued there, so one ingress
does not send a burst to the region that looked idle half a second ago.

Time is passed in (``now``, on the caller's monotonic clock): the simulation drives the
same code in virtual time (``switchyard bench federation``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from switchyard.schemas import RegionSummary, SessionPlacement

RegionPolicy = Literal["geo", "local", "blind"]
REGION_POLICIES: tuple[RegionPolicy, ...] = ("geo", "local", "blind")
RouteReason = Literal["home", "session", "spill", "blind", "local", "pinned"]

_RTT_WEIGHT = 0.3  # of a new round-trip sample in the moving average


@dataclass
class _Region:
    name: str
    summary: RegionSummary | None = None
    heard_at: float | None = None  # when its last summary came
    rtt_s: float | None = None  # moving average
    sent_tokens: int = 0  # uncached prompt tokens routed there since its last summary


@dataclass(frozen=True, slots=True)
class Route:
    region: str
    reason: RouteReason
    predicted_ttft_s: float  # of the region chosen (queue + prefill + round trip)


@dataclass
class RegionRouter:
    home: str
    policy: RegionPolicy = "geo"
    dark_after_s: float = 3.0
    default_prefill_tokens_per_s: float = 10_000.0  # a region that says no rate yet
    # An unbound request also leaves a home that is not saturated when another region would
    # give it its first token this much sooner, round trip included: home is saturated
    # relative to the others (bench federation at 100x the trace: 85% goodput against 80.5%
    # with the absolute threshold alone; at 50x, 88.2% against 88.6%).
    spill_margin_s: float = 0.5
    _regions: dict[str, _Region] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.policy not in REGION_POLICIES:
            raise ValueError(f"region policy {self.policy!r}: one of {', '.join(REGION_POLICIES)}")
        self._regions.setdefault(self.home, _Region(self.home, rtt_s=0.0))

    # --- what the ingress hears -----------------------------------------------------------

    def observe(self, summary: RegionSummary, now: float) -> None:
        region = self._regions.setdefault(summary.region, _Region(summary.region))
        if region.summary is not None and summary.scheduler_id == region.summary.scheduler_id:
            if summary.seq <= region.summary.seq:
                return  # an older one, overtaken on the way
        region.summary, region.heard_at, region.sent_tokens = summary, now, 0

    def measured(self, name: str, rtt_s: float) -> None:
        """A round trip to ``name`` took ``rtt_s`` (home's is taken as 0: no gateway)."""
        if name == self.home:
            return
        region = self._regions.setdefault(name, _Region(name))
        region.rtt_s = rtt_s if region.rtt_s is None else (1 - _RTT_WEIGHT) * region.rtt_s + _RTT_WEIGHT * rtt_s

    # --- queries --------------------------------------------------------------------------

    def regions(self) -> list[str]:
        return sorted(self._regions)

    def alive(self, name: str, now: float) -> bool:
        region = self._regions.get(name)
        return region is not None and region.heard_at is not None and now - region.heard_at <= self.dark_after_s

    def dark(self, now: float) -> list[str]:
        """The regions heard once and silent for ``dark_after_s`` since."""
        return sorted(n for n, r in self._regions.items() if r.heard_at is not None and not self.alive(n, now))

    def rtt_s(self, name: str) -> float | None:
        region = self._regions.get(name)
        return None if region is None else region.rtt_s

    def summary(self, name: str) -> RegionSummary | None:
        region = self._regions.get(name)
        return None if region is None else region.summary

    def predicted_ttft_s(self, name: str, uncached_tokens: int) -> float:
        """Queue there, then ``uncached_tokens`` of prefill, then the round trip. A region
        whose round trip is not measured yet costs as much as the slowest measured one.

        The queue drains at the region's whole prefill rate, but one prompt is prefilled on
        one instance: at the fleet rate over its prefill workers (a summary without a worker
        count counts as one), so a 10,000-token prompt costs the same in a region of 1 or
        of 100 workers, and recomputing it is weighed fairly against a round trip."""
        region = self._regions[name]
        _, instance = self._rates(region)
        return self._queue_s(name) + uncached_tokens / instance + self._rtt_or_worst(region)

    def _rates(self, region: _Region) -> tuple[float, float]:
        """(the region's prefill tokens/s, one instance's)."""
        summary = region.summary
        if summary is None or summary.prefill_tokens_per_s <= 0:
            return self.default_prefill_tokens_per_s, self.default_prefill_tokens_per_s
        fleet = summary.prefill_tokens_per_s
        return fleet, fleet / max(1, summary.prefill_workers)

    def _rtt_or_worst(self, region: _Region) -> float:
        if region.rtt_s is not None:
            return region.rtt_s
        return max((r.rtt_s for r in self._regions.values() if r.rtt_s is not None), default=0.0)

    def saturated(self, name: str) -> bool:
        """Its summary says so, or what this router sent it since would queue it past its
        spill threshold (a burst between two summaries)."""
        summary = self._regions[name].summary
        if summary is None:
            return False
        return summary.saturated or 0 < summary.spill_wait_s < self._queue_s(name)

    # --- the decision ---------------------------------------------------------------------

    def pin(self, name: str, prompt_tokens: int, placement: SessionPlacement | None) -> Route:
        """The caller named the region (``x-switchyard-region``): that one, counted as sent."""
        cached = min(placement.prompt_tokens, prompt_tokens) if placement and placement.region == name else 0
        self._regions.setdefault(name, _Region(name))
        return self._chosen(name, "pinned", prompt_tokens - cached)

    def route(
        self,
        prompt_tokens: int,
        placement: SessionPlacement | None,
        now: float,
        exclude: frozenset[str] = frozenset(),
    ) -> Route:
        """The region to submit to; ``exclude``: regions that refused this request already.
        Home is the answer when no region is known to do better (home's own scheduler then
        gives the real answer, a queue or a 429), even when home is excluded and no other
        region is left: the caller then knows it has no other choice."""

        def cached(name: str) -> int:
            if placement is None or placement.region != name:
                return 0
            return min(placement.prompt_tokens, prompt_tokens)

        def chosen(name: str, reason: RouteReason) -> Route:
            return self._chosen(name, reason, prompt_tokens - cached(name))

        def cost(name: str) -> tuple[float, bool, str]:
            # ties: home first, then by name, so a replay decides alike
            return (self.predicted_ttft_s(name, prompt_tokens - cached(name)), name != self.home, name)

        if self.policy == "local":
            return chosen(self.home, "local")
        candidates = self._candidates(now, exclude)
        if not candidates:
            return chosen(self.home, "home")
        if self.policy == "blind":
            return chosen(min(candidates, key=lambda n: (self._queue_s(n), n != self.home, n)), "blind")
        home_ok = self.home in candidates
        bound = placement.region if placement is not None and placement.region in candidates else None
        if bound is not None and bound != self.home:
            best = min([bound, self.home] if home_ok else [bound], key=cost)
            if best == bound or not self.saturated(self.home):
                return chosen(best, "session" if best == bound else "home")
            # recomputing wins, but not at a saturated home: spill it like an unbound request
        elif home_ok and not self.saturated(self.home) and not self._outdone(candidates, cost):
            return chosen(self.home, "home")
        open_ = [n for n in candidates if n != self.home and not self.saturated(n)]
        if not open_:
            # Every region is saturated: the least bad one, home winning ties (it pays no
            # round trip). Home alone would keep the overload where it started while the
            # others still have room between their spill threshold and their own refusals:
            # bench federation at 100x the trace, 67% goodput against 80% this way.
            open_ = candidates
        best = min(open_, key=cost)
        if best == self.home:
            return chosen(best, "home")
        return chosen(best, "session" if best == bound else "spill")

    def _outdone(self, candidates: list[str], cost: Callable[[str], tuple[float, bool, str]]) -> bool:
        """Another region, not saturated, would serve this request ``spill_margin_s`` sooner
        than home."""
        others = [cost(n)[0] for n in candidates if n != self.home and not self.saturated(n)]
        return bool(others) and min(others) + self.spill_margin_s < cost(self.home)[0]

    def _candidates(self, now: float, exclude: frozenset[str]) -> list[str]:
        """Regions that may get this request: alive (home also before its first summary:
        its own scheduler may be starting) and not excluded; sorted, for a stable order."""
        home = self._regions[self.home]
        home_ok = self.home not in exclude and (home.heard_at is None or self.alive(self.home, now))
        others = (n for n in self._regions if n != self.home and n not in exclude and self.alive(n, now))
        return sorted([*others, *([self.home] if home_ok else [])])

    def _queue_s(self, name: str) -> float:
        """Its predicted wait, plus what this router sent it since (at its fleet's rate)."""
        region = self._regions[name]
        fleet, _ = self._rates(region)
        return (region.summary.predicted_wait_s if region.summary else 0.0) + region.sent_tokens / fleet

    def _chosen(self, name: str, reason: RouteReason, uncached_tokens: int) -> Route:
        uncached_tokens = max(0, uncached_tokens)
        ttft = self.predicted_ttft_s(name, uncached_tokens)
        self._regions[name].sent_tokens += uncached_tokens
        return Route(name, reason, ttft)
