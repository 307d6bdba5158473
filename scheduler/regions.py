"""Which region serves a request: the pure decision of a federated ingress.

Every region's active scheduler publishes a ``RegionSummary`` (its predicted queue time,
its prefill rate, whether it is saturated); every ingress hears all of them, measures its
round trip to each region, and routes each request it admits with ``RegionRouter.route``:

- ``geo`` (the default): a request whose session the directory places in another region
  goes there when that region's predicted time to first token (its queue, the prompt
  minus the prefix it holds, the round trip) beats recomputing the prompt at home; a
  request with no binding stays home unless home is saturated, and then spills to the
  region with the lowest predicted TTFT plus round trip that is not saturated itself.
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

from dataclasses import dataclass, field
from typing import Literal

from switchyard.schemas import RegionSummary, SessionPlacement

RegionPolicy = Literal["geo", "local", "blind"]
REGION_POLICIES: tuple[RegionPolicy, ...] = ("geo", "local", "blind")
RouteReason = Literal["home", "session", "spill", "blind", "local"]

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
        whose round trip is not measured yet costs as much as the slowest measured one."""
        region = self._regions[name]
        summary = region.summary
        rate = (summary.prefill_tokens_per_s if summary else 0.0) or self.default_prefill_tokens_per_s
        wait = (summary.predicted_wait_s if summary else 0.0) + region.sent_tokens / rate
        return wait + uncached_tokens / rate + self._rtt_or_worst(region)

    def _rtt_or_worst(self, region: _Region) -> float:
        if region.rtt_s is not None:
            return region.rtt_s
        return max((r.rtt_s for r in self._regions.values() if r.rtt_s is not None), default=0.0)

    def saturated(self, name: str) -> bool:
        summary = self._regions[name].summary
        return summary is not None and summary.saturated

    # --- the decision ---------------------------------------------------------------------

    def route(
        self,
        prompt_tokens: int,
        placement: SessionPlacement | None,
        now: float,
        exclude: frozenset[str] = frozenset(),
    ) -> Route:
        """The region to submit to; ``exclude``: regions that refused this request already.
        Home is the answer when no region is known to do better (home's own scheduler then
        gives the real answer, a queue or a 429)."""
        candidates = [n for n in self._regions if n not in exclude and (n == self.home or self.alive(n, now))]
        home_ok = self.home not in exclude and (self.alive(self.home, now) or self._regions[self.home].heard_at is None)
        if self.policy == "local" or not candidates:
            return self._chosen(self.home, "local" if self.policy == "local" else "home", prompt_tokens)
        if not home_ok:
            candidates = [n for n in candidates if n != self.home] or [self.home]

        def cached(name: str) -> int:
            if placement is None or placement.region != name:
                return 0
            return min(placement.prompt_tokens, prompt_tokens)

        def cost(name: str) -> tuple[float, int, str]:
            # ties: home first, then by name, so a replay decides alike
            return (self.predicted_ttft_s(name, prompt_tokens - cached(name)), name != self.home, name)

        if self.policy == "blind":
            best = min(candidates, key=lambda n: (self._queue_s(n), n != self.home, n))
            return self._chosen(best, "blind", prompt_tokens - cached(best))
        if placement is not None and placement.region != self.home and placement.region in candidates:
            best = min(candidates, key=cost)
            return self._chosen(best, "session" if best == placement.region else "home", prompt_tokens - cached(best))
        if home_ok and not self.saturated(self.home):
            return self._chosen(self.home, "home", prompt_tokens - cached(self.home))
        open_ = [n for n in candidates if not self.saturated(n)] or candidates
        best = min(open_, key=cost)
        return self._chosen(best, "home" if best == self.home else "spill", prompt_tokens - cached(best))

    def _queue_s(self, name: str) -> float:
        region = self._regions[name]
        summary = region.summary
        rate = (summary.prefill_tokens_per_s if summary else 0.0) or self.default_prefill_tokens_per_s
        return (summary.predicted_wait_s if summary else 0.0) + region.sent_tokens / rate

    def _chosen(self, name: str, reason: RouteReason, uncached_tokens: int) -> Route:
        uncached_tokens = max(0, uncached_tokens)
        ttft = self.predicted_ttft_s(name, uncached_tokens)
        self._regions[name].sent_tokens += uncached_tokens
        return Route(name, reason, ttft)
