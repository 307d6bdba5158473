"""Prefill placement policies: small classes behind one protocol, chosen by name.

Each policy sees the workers that can take the request now (``candidates``: the right
role, within their token budget) and a ``PlacementView`` of what else it may read
(the prefix index's matches, the learned prefill rates). It returns one candidate, and
that choice is the placement: ``Placer`` commits whatever ``choose`` returns, so a
policy may record its own decisions there (the peers' routers all do).

    round_robin         cycle through the candidates
    least_requests      fewest requests in flight
    least_tokens        fewest uncached prompt tokens in flight
    sglang_cache_aware  SGLang model gateway's ``cache_aware`` (``prefix``: its old alias)
    dynamo_kv           Dynamo's KV router cost, lowest wins
    llmd                llm-d's default scheduling profile (prefix 3, queue 2, KV use 2)
    llmd_precise        llm-d's precise-prefix-cache profile (2, 1, 1, prefix from KV events)
    switchyard          lowest predicted time to first token: (queued uncached tokens +
                        this prompt's uncached tokens there, fetchable blocks credited) /
                        that worker's prefill rate; with a TTFT SLO, the worker that
                        computes least among those that keep it within half the time
                        left, and the core's SLO-aware queueing (``slo_aware``)

The peers' routers live in ``peers.py``, re-implemented from their own sources with their
own defaults.

Session affinity and tenant scoping are not policies: the core applies them around
whichever policy runs (see ``SchedulerCore``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import numpy as np
import numpy.typing as npt

from switchyard.scheduler.index import WorkerMatch
from switchyard.scheduler.native import native as _native
from switchyard.scheduler.peers import DynamoKv, Llmd, LlmdPrecise, SglangCacheAware
from switchyard.scheduler.state import Fleet, Tracked, WorkerState, lowest_id

log = logging.getLogger(__name__)

_SAFE_SHARE = 0.5  # switchyard: a placement keeps the SLO with room to spare within half the time left
_ALONE_SHARE = math.inf  # switchyard, a request alone in the queue: where none is safe (``safe_limits``)
# switchyard, colocated: what a prompt queued on the worker weighs in ``work``, a token of it
# against one of the prompt's own. Above 1, a worker with an empty queue wins over one that
# would compute a little less: at 1 the Azure colocated fleet's p90 TTFT was 35% over the
# best peer's at light load. From a sweep of 1, 2, 4 and 8 on the three colocated cases
# (docs/bench-sim.md): p90 TTFT falls and saturation goodput on Mooncake drops 0-3% as it
# grows; 4 is the least that brings Azure's light-load p90 within 2% of the best peer's.
# (That sweep counted the KV decoded as work too; without it, 1 and 2 were mixed at light
# load: TTFT p90 +29 ms on long documents, -12 ms on tool agents, at 1.) Only while the
# prefill fleet has capacity to spare: once it has been busy lately (``Fleet.busy``, the
# core's hold) a token computed is capacity the next request's SLO needs, and among workers
# that keep this one's SLO with room to spare the queue weighs nothing (``queue_weight``):
# at 4, a worker holding a 20k-token document lost the prompt to an idle one once it had
# 0.36 s queued, for 1.5 s of compute more.
_QUEUE_WEIGHT = 4.0
# The KV a colocated worker decodes is not work: between workers whose prompt and queue cost
# the same, one whose decodes have room for the prompt goes first (``crowds``), then, while
# the decodes have run within half the TPOT SLO lately (``Fleet.decode_slack``, set by the
# core), the one decoding least KV. Counted as work while decodes ran slow, as it once was,
# hundreds of thousands of tokens of KV outweighed the prompt's cached prefix, and prompts
# went where they recomputed it: on long shared documents, 8 colocated at 0.22, hit ratio
# 0.725 -> 0.753, goodput 6.19 -> 7.15 req/s and TPOT p90 105 -> 55 ms without it, since
# prefill computed is what stalls the decodes; lending and ``crowds`` guard the decodes.
# Breaking ties by KV then too did less (6.94).

# Of workers whose placement costs the same work and whose predicted TTFT is the quickest's
# too, the one whose cache took new content longest ago takes the prompt
# (``WorkerState.filled_at``), then the lowest id. Before, the lowest id always did: among
# the idle workers of a fleet, so one worker took most prompts cached nowhere, its cache
# churned and the others' held old content (long shared documents, 6 + 2 at light load:
# hit ratio 0.67 against SGLang's 0.78, whose misses go to the least loaded). Only exact
# ties: a worker up to 10 % slower but filled longer ago was tried too, and cost first
# tokens (Azure, 6 + 2, light load) for reuse no trace showed. Not on a fleet with
# colocated workers while it is busy (``spreads``): there a prompt shares its worker's
# iterations with the sequences it decodes, and spreading prompts over the workers spread
# their stalls over more decodes (tool agents at saturation: TPOT p90 43 -> 67 ms, goodput
# 8 % less). While it is not busy, colocated workers share one rate (``Fleet.learn_rate``)
# and ties spread as on a prefill fleet: before, one of eight took 54 % of the long
# documents cached nowhere (light load: TTFT p90 1,679 -> 1,472 ms, hit ratio 0.77 -> 0.82).


@dataclass(frozen=True)
class PlacementView:
    """One request's placement inputs. Only workers the index matched cost any work to
    look at: every other worker must compute the whole prompt (the common case in a
    large fleet, kept O(1) per worker)."""

    blocks: Mapping[str, int]  # worker id -> leading blocks of this prompt it reaches, any tier
    device_blocks: Mapping[str, int]  # worker id -> leading blocks on its own device tier
    block_size: int
    prefill_rate: Callable[[WorkerState], float]  # tokens/s
    fetch_credit: float  # share of a fetchable block's compute that fetching saves
    prompt_tokens: int
    ttft_budget_s: float = math.inf  # time left before it misses its TTFT SLO (-inf: late already)
    alone: bool = False  # no other request waits for a worker (``safe_limits``)

    @classmethod
    def of(cls, matches: Mapping[str, WorkerMatch], **rest: Any) -> PlacementView:
        """A view from ``PrefixIndex.match`` results (tests build it this way)."""
        return cls(
            blocks={w: m.blocks for w, m in matches.items()},
            device_blocks={w: m.device_blocks for w, m in matches.items()},
            **rest,
        )

    def matched(self, worker_id: str) -> bool:
        return self.blocks.get(worker_id, 0) > 0

    def cached_tokens(self, worker_id: str) -> int:
        return self.device_blocks.get(worker_id, 0) * self.block_size

    def uncached_tokens(self, worker: WorkerState) -> float:
        """Prompt tokens this worker must compute: device hits are free, blocks on its
        host/disk tier or in the cluster store cost only what fetching them costs."""
        blocks = self.blocks.get(worker.worker_id, 0)
        if not blocks:
            return float(self.prompt_tokens)
        device = self.device_blocks.get(worker.worker_id, 0)
        fetchable = (blocks - device) * self.block_size
        return max(0.0, self.prompt_tokens - device * self.block_size - self.fetch_credit * fetchable)

    def need(self, worker: WorkerState) -> int:
        """What the worker's ledger would hold: at least one token, since even a fully
        cached prompt computes its last token."""
        return max(1, math.ceil(self.uncached_tokens(worker)))


def queue_weight(fleet: Fleet | None) -> float:
    """``_QUEUE_WEIGHT``, or 0 while ``fleet`` has been busy lately (``Fleet.busy``) or has
    decode workers (its colocated workers then hand their decodes over, as prefill workers do)."""
    return 0.0 if fleet is not None and (fleet.busy or fleet.decode) else _QUEUE_WEIGHT


def worker_fleet_slack(worker: WorkerState) -> bool:
    """``Fleet.decode_slack`` of the worker's fleet (False for a worker in none)."""
    return worker.fleet is not None and worker.fleet.decode_slack


class PrefillPolicy(Protocol):
    name: ClassVar[str]
    # True when ``choose`` returns the least of a per-worker key: then the best of all
    # workers, if it fits, is also the best of those that fit (``Placer`` skips a pass).
    argmin: ClassVar[bool]
    # True when the core should queue a request predicted to miss the TTFT SLO
    # (``SchedulerConfig.ttft_slo_s``) behind those that can still meet it.
    slo_aware: ClassVar[bool]

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState: ...


class RoundRobin:
    name: ClassVar[str] = "round_robin"
    slo_aware: ClassVar[bool] = False
    argmin: ClassVar[bool] = False  # it cycles: the next after the last chosen depends on who fits

    def __init__(self) -> None:
        self._last = ""

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        # The next id after the last one chosen, wrapping: fair whatever the candidates.
        later = [w for w in candidates if w.worker_id > self._last]
        chosen = min(later or candidates, key=lambda w: w.worker_id)
        self._last = chosen.worker_id
        return chosen


class LeastRequests:
    name: ClassVar[str] = "least_requests"
    argmin: ClassVar[bool] = True  # the least of a key: the best of all, if it fits, is the best that fits
    slo_aware: ClassVar[bool] = False

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        return min(candidates, key=lambda w: (len(w.assigned), w.worker_id))


class LeastTokens:
    name: ClassVar[str] = "least_tokens"
    argmin: ClassVar[bool] = True
    slo_aware: ClassVar[bool] = False

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        return min(candidates, key=lambda w: (w.load_tokens, w.worker_id))


def safe_limits(ttft_budget_s: float, alone: bool) -> tuple[float, float]:
    """``switchyard``'s predicted TTFT within which a worker counts as safe, the second
    where none is within the first: half the time left before the SLO; for a request
    ``alone`` (the core: alone in the queue, on a busy fleet with decode workers), then any.
    Nobody waits behind it, so a worker that computes less costs no other request its SLO;
    if it is too slow for this one's, the core's SLO check sends it the late way
    (``SchedulerCore._misses_slo``). With others waiting, the quickest: they wait behind
    whatever it takes. (Long documents 6 + 2 at the best peer's peak: TTFT p90 2,514 ->
    2,286 ms, hit ratio 0.688 -> 0.740, goodput at its own peak unchanged; within the time
    left, not any, 2,405 ms.) A late request (-inf) has no safe worker."""
    half = _SAFE_SHARE * ttft_budget_s
    if not alone or not ttft_budget_s > 0:
        return (half, half)
    return (half, _ALONE_SHARE * ttft_budget_s)


class Switchyard:
    """One cost, lower is better: the predicted time to first token on each worker."""

    name: ClassVar[str] = "switchyard"
    # Not the least of one key: which worker took new content last decides between the
    # quickest, so the choice among all is not always the choice among those that fit.
    argmin: ClassVar[bool] = False
    slo_aware: ClassVar[bool] = True

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        if view.ttft_budget_s < math.inf:
            # Among the workers where it would keep its SLO with room to spare, the one that
            # computes least: cache reuse is capacity, and capacity is the next request's SLO.
            first, second = safe_limits(view.ttft_budget_s, view.alone)
            safe = [w for w in candidates if self.predicted_ttft_s(w, view) <= first]
            safe = safe or [w for w in candidates if self.predicted_ttft_s(w, view) <= second]
            if safe:
                slack = worker_fleet_slack(safe[0])

                def key(w: WorkerState) -> tuple[float, bool, int]:
                    tie = w.kv_tokens if slack and w.role == "both" else 0
                    return (self.work(w, view), self.crowds(w, view), tie)

                least = min(key(w) for w in safe)
                return self.spread([w for w in safe if key(w) == least], view)
        quickest = min(self.predicted_ttft_s(w, view) for w in candidates)
        computes = min(view.uncached_tokens(w) for w in candidates if self.predicted_ttft_s(w, view) == quickest)
        best = self.spread([w for w in candidates if view.uncached_tokens(w) == computes], view)
        if log.isEnabledFor(logging.DEBUG):
            self.cost(best, request, view)  # logs the winner's terms
        return best

    @classmethod
    def spread(cls, equals: list[WorkerState], view: PlacementView) -> WorkerState:
        """Of workers whose placement costs the same work, the quickest; of those, the one
        whose cache took new content longest ago (not on a busy fleet with colocated
        workers), then the lowest id."""
        quickest = min(cls.predicted_ttft_s(w, view) for w in equals)
        tied = [w for w in equals if cls.predicted_ttft_s(w, view) == quickest]
        fleet = tied[0].fleet
        by_filled = spreads(fleet) if fleet is not None else not any(w.role == "both" for w in tied)
        return min(tied, key=lambda w: (w.filled_at if by_filled else 0.0, w.worker_id))

    def choose_slots(
        self,
        request: Tracked,
        fleet: Fleet,
        slots: npt.NDArray[np.intp],
        uncached: npt.NDArray[np.float64],
        view: PlacementView,
    ) -> WorkerState:
        """``choose`` over the fleet's workers at ``slots`` (``uncached``: each one's
        ``view.uncached_tokens``) as vector expressions: the same IEEE operations on the
        same values as ``predicted_ttft_s`` and ``work``, the same order of keys, ties to
        the lowest id, so the very same choice."""
        load = fleet.load[slots]
        predicted = (load + uncached) / fleet.rate[slots]
        if view.ttft_budget_s < math.inf:
            first, second = safe_limits(view.ttft_budget_s, view.alone)
            safe = predicted <= first
            if not safe.any():
                safe = predicted <= second
            if safe.any():
                colocated = fleet.colocated[slots] != 0
                queued = uncached + queue_weight(fleet) * load
                work = np.where(colocated, queued, uncached)  # the KV is not work (its note above)
                safe &= work == work[safe].min()
                crowds = colocated & (uncached > fleet.room_edge[slots] - fleet.placed[slots])
                safe &= crowds == crowds[safe].min()
                if fleet.decode_slack:
                    kv = np.where(colocated, fleet.kv[slots], 0.0)
                    safe &= kv == kv[safe].min()
                return spread_slots(fleet, slots, safe, predicted)
        quickest = predicted == predicted.min()
        best = spread_slots(fleet, slots, uncached == uncached[quickest].min(), predicted)
        if log.isEnabledFor(logging.DEBUG):
            self.cost(best, request, view)  # logs the winner's terms
        return best

    def choose_native(
        self,
        request: Tracked,
        fleet: Fleet,
        slots: npt.NDArray[np.intp],
        rows: npt.NDArray[np.intp],
        blocks: npt.NDArray[np.int32],
        device: npt.NDArray[np.int32],
        fetch_credit: float,
        ttft_budget_s: float,
        alone: bool = False,
    ) -> tuple[WorkerState, int] | None:
        """``Placer``'s uncached tokens, fit and ``choose_slots`` of the fleet's workers at
        ``slots``, in one loop in C (``_native.choose_prefill``: the same operations, so the
        same choice), from the index's ``match_slots`` arrays (``rows``: each fleet slot's
        index slot). The chosen worker and what its ledger takes, or None if none fits."""
        limit, then = safe_limits(ttft_budget_s, alone) if ttft_budget_s < math.inf else (math.inf, math.inf)
        budget = fleet.fit_budget()  # (it reads the rates: before native_rates)
        rate, prefill_scale, both_scale = fleet.native_rates()
        chosen = _native.choose_prefill(
            fleet.load, rate, budget, fleet.kv, fleet.kv_cap, fleet.holding, fleet.colocated,
            fleet.id_rank(), slots, rows, blocks, device, request.prompt_tokens, request.spec.block_size,
            fetch_credit, request.decode_tokens, bool(fleet.roles["both"]), limit, then, queue_weight(fleet),
            fleet.decode_slack, fleet.placed, fleet.room_edge, fleet.factor, prefill_scale, both_scale,
            fleet.filled, spreads(fleet),
        )  # fmt: skip
        if chosen is None:
            return None
        slot, need = chosen
        best = fleet.workers[fleet.ids[slot]]  # type: ignore[index]  # a slot of the fleet's: taken
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "cost %s on %s = (queued %d + need %d of %d) / %.0f tok/s",
                request.spec.request_id, best.worker_id, best.load_tokens, need, request.prompt_tokens,
                best.prefill_rate,
            )  # fmt: skip
        return best, int(need)

    @staticmethod
    def work(worker: WorkerState, view: PlacementView) -> float:
        """What placing the prompt there costs the fleet, in tokens: its uncached tokens; on
        a colocated worker also the prompts queued there, ``queue_weight`` times (its own
        first token waits on them)."""
        if worker.role != "both":
            return view.uncached_tokens(worker)
        return view.uncached_tokens(worker) + queue_weight(worker.fleet) * worker.load_tokens

    @staticmethod
    def crowds(worker: WorkerState, view: PlacementView) -> bool:
        """Whether the prompt would push a decode on this colocated worker past its TPOT
        SLO (``WorkerState.room_tokens``)."""
        return worker.role == "both" and view.uncached_tokens(worker) > worker.room_tokens

    @staticmethod
    def predicted_ttft_s(worker: WorkerState, view: PlacementView) -> float:
        # The ledger holds the uncached tokens placed there and not yet done.
        return (worker.load_tokens + view.uncached_tokens(worker)) / view.prefill_rate(worker)

    @classmethod
    def cost(cls, worker: WorkerState, request: Tracked, view: PlacementView) -> float:
        """``predicted_ttft_s``, with its terms logged at debug level."""
        cost = cls.predicted_ttft_s(worker, view)
        log.debug(
            "cost %s on %s = (queued %d + uncached %.0f of %d) / %.0f tok/s = %.4f s",
            request.spec.request_id,
            worker.worker_id,
            worker.load_tokens,
            view.uncached_tokens(worker),
            request.prompt_tokens,
            view.prefill_rate(worker),
            cost,
        )
        return cost


def spreads(fleet: Fleet) -> bool:
    """Whether ties go to the worker filled longest ago: not on a fleet of colocated
    workers (with no decode workers beside them) while it has been busy lately."""
    return not fleet.roles["both"] or bool(fleet.decode) or not fleet.busy


def spread_slots(
    fleet: Fleet, slots: npt.NDArray[np.intp], equals: npt.NDArray[np.bool_], predicted: npt.NDArray[np.float64]
) -> WorkerState:
    """``Switchyard.spread`` of the workers at ``slots[equals]``."""
    tied = equals & (predicted == predicted[equals].min())
    if spreads(fleet):
        filled = fleet.filled[slots]
        tied &= filled == filled[tied].min()
    return lowest_id(fleet, slots[tied])


POLICIES: dict[str, Callable[[], PrefillPolicy]] = {
    cls.name: cls
    for cls in (RoundRobin, LeastRequests, LeastTokens, SglangCacheAware, DynamoKv, Llmd, LlmdPrecise, Switchyard)
}
# The straw man this name once meant is retired; old configs get the faithful SGLang policy.
POLICIES["prefix"] = SglangCacheAware


def make_policy(name: str) -> PrefillPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(sorted(POLICIES))}") from None


def decode_cost(worker: WorkerState, saved: float = 0) -> tuple[float, int, str]:
    """Decode placement: KV tokens held against capacity, less ``saved`` (the tokens of the
    prompt that decodes there already hold, as the caller weighs them:
    ``placement._SHARE_WEIGHT``), then sequences running."""
    return ((worker.load_tokens - saved) / max(1, worker.token_budget), len(worker.assigned), worker.worker_id)
