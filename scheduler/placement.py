"""Placement: which worker takes the next phase of a request. Pure functions of state.

Prefill: the candidates are the prefill-capable workers (role ``prefill`` or ``both``)
within their budget for this prompt's *uncached* tokens there; a session bound to one
of them goes back to it while that worker stays under ``session_max_load`` of its
budget; otherwise the configured policy chooses. Conditional disaggregation comes
first: a prompt whose uncached part on some decode worker is at most
``local_prefill_max_tokens`` is prefilled by that decode worker itself (no handoff).

Decode: the decode worker holding the fewest KV tokens against its capacity.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.index import PrefixIndex
from switchyard.scheduler.policies import PlacementView, decode_cost, make_policy
from switchyard.scheduler.state import Tracked, WorkerState


@dataclass(frozen=True, slots=True)
class Placement:
    worker: WorkerState
    kind: Literal["prefill", "local"]
    tokens: int  # what the worker's ledger holds for the request


class Placer:
    def __init__(self, config: SchedulerConfig, index: PrefixIndex) -> None:
        self.config = config
        self.index = index
        self.policy = make_policy(config.policy)

    def prefill(
        self,
        request: Tracked,
        workers: Iterable[WorkerState],
        bound_worker: str | None,
        ttft_budget_s: float = math.inf,
    ) -> Placement | None:
        workers = list(workers)
        blocks, device = self.index.match_counts(request.spec.block_keys)
        view = PlacementView(
            blocks=blocks,
            device_blocks=device,
            block_size=request.spec.block_size,
            prefill_rate=lambda w: w.prefill_rate,
            fetch_credit=self.config.fetch_credit,
            prompt_tokens=request.prompt_tokens,
            ttft_budget_s=ttft_budget_s,
        )
        local = self._local(request, workers, view)
        if local is not None:
            return local
        capable = [w for w in workers if w.role != "decode"]
        chosen = self._quick(request, capable, bound_worker, view)
        if chosen is None:
            fitting = [w for w in capable if self._fits(w, request, view)]
            if not fitting:
                return None
            chosen = self._bound(fitting, bound_worker, view) or self.policy.choose(request, fitting, view)
        return Placement(chosen, "prefill", view.need(chosen))

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

    def decode(self, request: Tracked, workers: Iterable[WorkerState]) -> WorkerState | None:
        tokens = request.decode_tokens  # a computed property: once, not once a worker
        fitting = [w for w in workers if w.role == "decode" and w.fits(tokens)]
        return min(fitting, key=decode_cost) if fitting else None

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
