"""Placement: pick a worker for a phase of a request. Pure functions of the state.

One cost, lower is better: the tokens the worker already holds for us (its ledger).
Prefill spends them as compute, decode as KV memory. A session bound to a worker
goes back to it while that worker has room, so its prefix is found warm.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from scheduler.state import Tracked, WorkerState

log = logging.getLogger(__name__)


def pick_prefill(
    workers: Iterable[WorkerState], request: Tracked, bound_worker: str | None
) -> WorkerState | None:
    fitting = [w for w in workers if w.role == "prefill" and w.fits(request.prompt_tokens)]
    for worker in fitting:
        if worker.worker_id == bound_worker:
            return worker
    return _cheapest(fitting, request)


def pick_decode(workers: Iterable[WorkerState], request: Tracked) -> WorkerState | None:
    fitting = [w for w in workers if w.role == "decode" and w.fits(request.decode_tokens)]
    return _cheapest(fitting, request)


def _cheapest(candidates: list[WorkerState], request: Tracked) -> WorkerState | None:
    if not candidates:
        return None
    best = min(candidates, key=lambda w: (w.load_tokens, w.worker_id))
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "place %s on %s: load_tokens=%d budget=%d (of %d candidates)",
            request.spec.request_id, best.worker_id, best.load_tokens, best.token_budget,
            len(candidates),
        )
    return best
