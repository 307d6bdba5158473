"""Placement: which worker takes the next phase of a request. Pure functions of state.

Prefill: the candidates are the prefill-capable workers (role ``prefill`` or ``both``)
within their budget for this prompt's *uncached* tokens there; a session bound to one
of them goes back to it while that worker stays under ``session_max_load`` of its
budget; otherwise the configured policy chooses. Conditional disaggregation comes
first: a prompt whose uncached part on some decode worker is at most
``local_prefill_max_tokens`` is prefilled by that decode worker itself (no handoff).

Decode: the decode worker holding the fewest KV tokens against its capacity; on a
colocated fleet, the lent worker decoding fewest (``lending.pick_decode``).

Given the core's ``Fleet`` (not a list of workers), both are decided from its arrays by
slot where that gives the very same answer: the decode pick always, and a prefill policy
that can score slots (``choose_slots``: ``switchyard``, with or without a TTFT SLO, unless a
session binds the request) from the index's ``match_slots``. No Python loop over the fleet then, and no worker id looked at but the
winners' (``docs/bench-scheduler.md``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import numpy as np
import numpy.typing as npt

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import PrefixIndex
from switchyard.scheduler.lending import pick_decode
from switchyard.scheduler.native import native as _native
from switchyard.scheduler.policies import PlacementView, decode_cost, make_policy
from switchyard.scheduler.state import Fleet, Tracked, WorkerState, lowest_id, shareable_keys
from switchyard.schemas import RequestSpec

# The decode pick: a token of the prompt that a decode worker already holds (in its running
# decodes, or cached on its device) counts this many times off that worker's load. At 1 the
# pick balanced the load after placement, and left a worker holding a prompt whenever the other
# was lighter by more than the prompt's shared part: both then held the document, twice the
# memory, and the requests after it found it on both. A decode fleet bound by its KV memory
# (long shared documents on 6 + 2: decode workers full, prefill workers half idle) serves as
# many requests as its memory holds at once, so what a placement saves there is capacity for
# every later request of the same prefix while the decodes run. From the disaggregated cases of
# the matrix and the synthetic and Mooncake-synthetic traces (docs/bench-sim.md), 1, 2, 4, 8 and
# no limit (the most sharing always): long documents at the heaviest load 7.87, 8.14, 8.29, 7.97
# and 7.76 req/s (seeds 1 and 2 of that trace: +3.7 % and -0.8 % at 4); the others within
# 3 % either way. Past 4 one worker takes most decodes of a document and runs slower.
_SHARE_WEIGHT = 4.0


@dataclass(slots=True)  # not frozen: a frozen dataclass's __init__ sets each field by a call
class Placement:
    worker: WorkerState
    kind: Literal["prefill", "local"]
    tokens: int  # what the worker's ledger holds for the request


class Placer:
    def __init__(self, config: SchedulerConfig, index: PrefixIndex) -> None:
        self.config = config
        self.index = index
        self.policy = make_policy(config.policy)
        self._slots = _IndexSlots(index)
        # What the policy can do, looked up once (``prefill`` asks for every request).
        self._by_slot = hasattr(self.policy, "choose_slots")
        self._choose_native = getattr(self.policy, "choose_native", None)
        # A peer's own decode routing (``peers.py``: each routes decode workers by its own
        # scores, as in its P/D mode); other policies take the core's pick (``decode_cost``).
        self._choose_decode = getattr(self.policy, "choose_decode", None)
        self._decode_mask: tuple[tuple[int, int], int] = ((-1, -1), 0)  # (fleet, index versions), mask

    def prefill(
        self,
        request: Tracked,
        workers: Iterable[WorkerState] | Fleet,
        bound_worker: str | None,
        ttft_budget_s: float = math.inf,
        alone: bool = False,
    ) -> Placement | None:
        """Where the request prefills (``alone``: no other request waits for a worker;
        ``PlacementView.alone``), or None if no worker takes it now."""
        if self._by_slot and isinstance(workers, Fleet):
            return self._prefill_by_slot(request, workers, bound_worker, ttft_budget_s, alone)
        workers = list(workers)
        blocks, device = self.index.match_counts(request.spec.block_keys)
        view = self._view(request, blocks, device, ttft_budget_s, alone)
        local = self._local(request, workers, view)
        if local is not None:
            return local
        capable = [w for w in workers if w.role != "decode"]
        chosen = self._quick(request, capable, bound_worker, view)
        return self._commit(request, chosen, capable, bound_worker, view)

    def _prefill_by_slot(
        self, request: Tracked, fleet: Fleet, bound_worker: str | None, ttft_budget_s: float, alone: bool
    ) -> Placement | None:
        """``prefill`` with the index's answer as arrays by slot: the same view (its maps
        read those arrays), and without a session binding the policy scores the fleet's
        prefill slots in vector expressions instead of ``_quick``'s loop."""
        blocks, device = self.index.match_slots(request.spec.block_keys)
        slot_of = self._slots.of_index()
        native = self._choose_native if self.index.native else None
        if native is not None and bound_worker is None and fleet.prefill and self.config.local_prefill_max_tokens <= 0:
            # The policy's whole choice in one loop in C (``_native.c``): the same as below.
            rows = self._slots.rows(fleet)
            best = native(
                request, fleet, fleet.slots("prefill"), rows, blocks, device, self.config.fetch_credit, ttft_budget_s,
                alone,
            )  # fmt: skip
            return None if best is None else Placement(best[0], "prefill", best[1])
        view = self._view(request, _BySlot(blocks, slot_of), _BySlot(device, slot_of), ttft_budget_s, alone)
        if self.config.local_prefill_max_tokens > 0:
            local = self._local(request, list(fleet), view)
            if local is not None:
                return local
        if bound_worker is not None or not fleet.prefill:
            capable = list(fleet.prefill.values())
            chosen = self._quick(request, capable, bound_worker, view)
            return self._commit(request, chosen, capable, bound_worker, view)
        # The policy's choice among the workers that fit: what ``_quick`` finds (the best of
        # all, if it fits) or else ``_commit`` (the best of those that fit), for a policy
        # whose choice among a subset that holds its choice among all is that same worker
        # (``argmin``; ``switchyard``'s SLO rule too: the least of the safe, else the fastest).
        slots = fleet.slots("prefill")
        rows = self._slots.rows(fleet)[slots]
        uncached = _uncached(view, np.append(blocks, 0)[rows], np.append(device, 0)[rows])
        fit = _fitting(fleet, slots, uncached, request.decode_tokens)
        if not fit.any():
            return None
        chosen = self.policy.choose_slots(request, fleet, slots[fit], uncached[fit], view)  # type: ignore[attr-defined]
        assert self._fits(chosen, request, view), chosen.worker_id
        return Placement(chosen, "prefill", view.need(chosen))

    def cheap(
        self, request: Tracked, workers: Iterable[WorkerState], most_s: float, within_s: float = math.inf
    ) -> Placement | None:
        """Of the ``workers`` that fit the prompt and would compute at most ``most_s`` of it
        at their prefill rate (a cached prefix there, or a short prompt), and would have it
        done, behind their queue, within ``within_s``: the one that computes least, then the
        soonest done, then the lowest id; None if there is none."""
        blocks, device = self.index.match_counts(request.spec.block_keys)
        view = self._view(request, blocks, device, -math.inf)
        best: tuple[tuple[float, float, str], WorkerState] | None = None
        for worker in workers:
            if worker.role == "decode":
                continue
            uncached = view.uncached_tokens(worker)
            if uncached > most_s * worker.prefill_rate or not self._fits(worker, request, view):
                continue
            done_s = (worker.load_tokens + uncached) / worker.prefill_rate
            if done_s > within_s:
                continue
            key = (uncached, done_s, worker.worker_id)
            if best is None or key < best[0]:
                best = (key, worker)
        return None if best is None else Placement(best[1], "prefill", view.need(best[1]))

    def need(self, request: Tracked, worker: WorkerState) -> int:
        """What one worker's ledger would hold for the prompt: its uncached tokens there."""
        blocks, device = self.index.match_counts(request.spec.block_keys, [worker.worker_id])
        return self._view(request, blocks, device, math.inf).need(worker)

    def _commit(
        self,
        request: Tracked,
        chosen: WorkerState | None,
        capable: list[WorkerState],
        bound_worker: str | None,
        view: PlacementView,
    ) -> Placement | None:
        if chosen is None:
            fitting = [w for w in capable if self._fits(w, request, view)]
            if not fitting:
                return None
            chosen = self._bound(fitting, bound_worker, view) or self.policy.choose(request, fitting, view)
        return Placement(chosen, "prefill", view.need(chosen))

    def _view(
        self,
        request: Tracked,
        blocks: Mapping[str, int],
        device: Mapping[str, int],
        ttft_budget_s: float,
        alone: bool = False,
    ) -> PlacementView:
        return PlacementView(
            blocks=blocks,
            device_blocks=device,
            block_size=request.spec.block_size,
            prefill_rate=lambda w: w.prefill_rate,
            fetch_credit=self.config.fetch_credit,
            prompt_tokens=request.prompt_tokens,
            ttft_budget_s=ttft_budget_s,
            alone=alone,
        )

    def _quick(
        self, request: Tracked, capable: list[WorkerState], bound_worker: str | None, view: PlacementView
    ) -> WorkerState | None:
        """For a policy that takes the least of a key, the best of all workers, if it
        fits, is the best of those that fit: skip the pass that filters the fleet. Not
        with a session binding (it is decided among the fitting workers)."""
        if not capable or bound_worker is not None or not self.policy.argmin:
            return None
        best = self.policy.choose(request, capable, view)
        return best if self._fits(best, request, view) else None

    @staticmethod
    def _fits(worker: WorkerState, request: Tracked, view: PlacementView) -> bool:
        return worker.fits(view.need(worker)) and (worker.role != "both" or worker.kv_room(request.decode_tokens))

    def decode(
        self, request: Tracked, workers: Iterable[WorkerState] | Fleet, idle_only: bool = False
    ) -> WorkerState | None:
        """Where a prefilled request decodes: of the decode workers it fits (its KV less
        the prompt blocks decodes there already hold, ``WorkerState.assign_decode``), the
        least loaded once those blocks are taken off ``_SHARE_WEIGHT`` times (``decode_cost``),
        or the prompt blocks its device still caches where more (they need no handoff: the KV
        connector loads only what the device lacks; ``_decode_by_slot``); for a peer, the one
        its own decode routing picks among them (``_peer_decode``). ``idle_only``: of the
        decode workers decoding nothing (the core's decodes run slow, ``_DECODE_FULL``)."""
        tokens, spec = request.decode_tokens, request.spec  # computed once, not once a worker
        if isinstance(workers, Fleet):
            if workers.lent or (workers.roles["both"] and not workers.decode):
                return pick_decode(workers, tokens, spec)  # colocated: handed over to a lent (or decode) worker
            if idle_only:
                return min(_idle_decode(workers.decode.values()), key=decode_cost, default=None)
            if self._choose_decode is None:
                cached = self._decode_cached(spec, workers)
                return _decode_by_slot(workers, tokens, self.index.native, workers.decode_sharing(spec), cached)
            workers = workers.decode.values()
        if idle_only:
            return min(_idle_decode(workers), key=decode_cost, default=None)
        decoding = [(w, w.sharing(shareable_keys(spec, w))) for w in workers if w.role == "decode"]
        fitting = [(w, saved) for w, saved in decoding if w.fits(tokens - saved)]
        if not fitting:
            return None
        if self._choose_decode is not None:
            return self._peer_decode(request, [w for w, _ in fitting])
        _, device = self.index.match_counts(spec.block_keys, [w.worker_id for w, _ in fitting])
        size = spec.block_size
        weight = _SHARE_WEIGHT
        return min(
            fitting, key=lambda ws: decode_cost(ws[0], weight * max(ws[1], device.get(ws[0].worker_id, 0) * size))
        )[0]

    def _decode_cached(self, spec: RequestSpec, fleet: Fleet) -> npt.NDArray[np.int64] | None:
        """By fleet slot, the prompt tokens on a worker's device tier as the index knows it
        (for a decode worker, blocks handed to it before and still cached); None where no
        decode worker holds its first block there."""
        version = (fleet.version, self.index.ids_version)
        if self._decode_mask[0] != version:  # the decode workers as the index's walk mask
            self._decode_mask = (version, self.index.mask(w.worker_id for w in fleet.decode.values()))
        _, device = self.index.match_slots(spec.block_keys, wanted=self._decode_mask[1])
        if not device.any():
            return None
        self._slots.of_index()
        return np.append(device, 0)[self._slots.rows(fleet)].astype(np.int64) * spec.block_size

    def _peer_decode(self, request: Tracked, fitting: list[WorkerState]) -> WorkerState:
        """A peer's decode routing among the decode workers that fit: its scores over what
        the index says they cache (decode workers report the blocks handed to them)."""
        blocks, device = self.index.match_counts(request.spec.block_keys, [w.worker_id for w in fitting])
        view = self._view(request, blocks, device, math.inf)
        chosen: WorkerState = self._choose_decode(request, fitting, view)  # type: ignore[misc]
        return chosen

    def _bound(self, fitting: list[WorkerState], bound_worker: str | None, view: PlacementView) -> WorkerState | None:
        if bound_worker is None:
            return None
        for worker in fitting:
            if worker.worker_id == bound_worker:
                after = worker.load_tokens + view.need(worker)
                return worker if after <= self.config.session_max_load * worker.token_budget else None
        return None

    def _local(self, request: Tracked, workers: list[WorkerState], view: PlacementView) -> Placement | None:
        limit = self.config.local_prefill_max_tokens
        if limit <= 0:
            return None
        fitting = [
            w
            for w in workers
            if w.role == "decode" and w.fits(request.decode_tokens) and view.uncached_tokens(w) <= limit
        ]
        if not fitting:
            return None
        return Placement(min(fitting, key=decode_cost), "local", request.decode_tokens)


def _uncached(
    view: PlacementView, blocks: npt.NDArray[np.int32], device: npt.NDArray[np.int32]
) -> npt.NDArray[np.float64]:
    """``view.uncached_tokens`` for many workers at once, given their matched blocks: the
    same operations in the same order on the same values (ints exact in float64), so the
    very same floats."""
    size = view.block_size
    prompt = view.prompt_tokens
    fetchable = (blocks.astype(np.int64) - device) * size
    computed = (prompt - device.astype(np.int64) * size) - view.fetch_credit * fetchable
    return np.where(blocks > 0, np.maximum(0.0, computed), float(prompt))


def _fitting(
    fleet: Fleet, slots: npt.NDArray[np.intp], uncached: npt.NDArray[np.float64], decode_tokens: int
) -> npt.NDArray[np.bool_]:
    """``Placer._fits`` of each worker at ``slots``: its ledger takes ``view.need`` (at least
    one token, ``uncached`` rounded up) within ``Fleet.fit_budget``, and a colocated one has
    KV room for the request."""
    need = np.maximum(1.0, np.ceil(uncached))
    load = fleet.load[slots]
    fits: npt.NDArray[np.bool_] = (load == 0) | (load + need <= fleet.fit_budget()[slots])
    if not fleet.roles["both"]:
        return fits  # no colocated worker: no KV room to check
    kv_room = (fleet.holding[slots] == 0) | (fleet.kv[slots] + decode_tokens <= fleet.kv_cap[slots])
    fitting: npt.NDArray[np.bool_] = fits & ((fleet.colocated[slots] == 0) | kv_room)
    return fitting


def _decode_by_slot(
    fleet: Fleet,
    tokens: int,
    native: bool = False,
    saved: npt.NDArray[np.int32] | None = None,
    cached: npt.NDArray[np.int64] | None = None,
) -> WorkerState | None:
    """``Placer.decode`` from the fleet's arrays: among the decode workers that fit, the
    least ``decode_cost`` (KV load share, then sequences running, then the id); ``saved``
    (tokens by slot, ``Fleet.decode_sharing``): the prompt's tokens decodes there already
    hold, which it needs less there and which count ``_SHARE_WEIGHT`` times off that
    worker's load; ``cached`` (tokens by slot): the prompt's tokens on a worker's device,
    which count so off its load where more than ``saved`` (no handoff for them), not off
    its room (reused, they are held again); ``native``: without ``cached``, that same loop
    in C."""
    slots = fleet.slots("decode")
    if native and cached is None:
        slot = _native.choose_decode(
            fleet.load, fleet.budget, fleet.running, fleet.id_rank(), slots, tokens, saved, _SHARE_WEIGHT
        )
        return fleet.workers[fleet.ids[slot]] if slot >= 0 else None  # type: ignore[index]  # a taken slot
    load, budget = fleet.load[slots], fleet.budget[slots]
    held = saved[slots] if saved is not None else np.zeros(len(slots), dtype=np.int64)
    fits = (load == 0) | (load + tokens - held <= budget)
    slots = slots[fits]
    if not len(slots):
        return None
    credit = held[fits] if cached is None else np.maximum(held[fits], cached[slots])
    share = (load[fits] - _SHARE_WEIGHT * credit) / np.maximum(1.0, budget[fits])
    slots = slots[share == share.min()]
    if len(slots) > 1:
        running = fleet.running[slots]
        slots = slots[running == running.min()]
    return lowest_id(fleet, slots)


def _idle_decode(workers: Iterable[WorkerState]) -> list[WorkerState]:
    return [w for w in workers if w.role == "decode" and not w.assigned]


class _IndexSlots:
    """The index's worker slots (``worker_slots``) against the fleet's: which index slot
    each fleet slot's worker has (``rows``; the index's slot count, one past its last, for a
    worker it does not know, where the padded arrays read 0), and each known worker's
    index slot (``of_index``). Rebuilt when either side's workers change."""

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self._ids: list[str | None] = []
        self._slot_of: dict[str, int] = {}
        self._rows: npt.NDArray[np.intp] = np.zeros(0, dtype=np.intp)
        self._rows_for: tuple[int, int] = (-1, -1)  # (fleet version, index ids version)
        self._ids_version = 0
        self._index_version = -1  # the index's ``ids_version`` ``_ids`` was read at

    def of_index(self) -> dict[str, int]:
        if self.index.ids_version != self._index_version:  # a join or a departure there
            self._index_version = self.index.ids_version
            ids = self.index.worker_slots()
            if ids != self._ids:
                self._ids, self._ids_version = ids, self._ids_version + 1
                self._slot_of = {w: s for s, w in enumerate(ids) if w is not None}
        return self._slot_of

    def rows(self, fleet: Fleet) -> npt.NDArray[np.intp]:
        """By fleet slot; call ``of_index`` first (it checks the index's side)."""
        if self._rows_for != (fleet.version, self._ids_version) or len(self._rows) != len(fleet.ids):
            missing = len(self._ids)
            self._rows = np.array([self._slot_of.get(w, missing) if w else missing for w in fleet.ids], dtype=np.intp)
            self._rows_for = (fleet.version, self._ids_version)
        return self._rows


class _BySlot(Mapping[str, int]):
    """Worker id -> count, read from a ``match_slots`` array by index slot; like
    ``match_counts``' maps it holds only the workers with a count above 0."""

    def __init__(self, counts: npt.NDArray[np.int32], slot_of: dict[str, int]) -> None:
        self._counts, self._slot_of = counts, slot_of

    def __getitem__(self, worker_id: str) -> int:
        count = int(self._counts[self._slot_of[worker_id]])
        if not count:
            raise KeyError(worker_id)
        return count

    def get(self, worker_id: str, default: int | None = None) -> int | None:  # type: ignore[override]
        slot = self._slot_of.get(worker_id)
        count = 0 if slot is None else int(self._counts[slot])
        return count if count else default

    def __iter__(self) -> Iterator[str]:
        return (w for w, s in self._slot_of.items() if self._counts[s])

    def __len__(self) -> int:
        return int(np.count_nonzero(self._counts))
