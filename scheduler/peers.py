"""The peers' routers, re-implemented as prefill policies from their own sources.

Each class names the repository and files it follows and the defaults it reproduces, then
lists where it deliberately differs: mostly where our inputs are not theirs (block keys
instead of text or token hashes, the scheduler's ledgers instead of scraped metrics, only
the candidates that fit). Ties, random in all three, go to the lowest worker id here, so a
replay is deterministic. Like the peers, these policies keep books of what they routed
(an approximate cache, active sequences); ``Placer`` commits every choice, so the books
are written in ``choose`` and read back against the workers' ledgers.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar, Literal

from switchyard.scheduler.state import Tracked, WorkerState

if TYPE_CHECKING:  # policies.py registers these classes: a runtime import would be a cycle
    from switchyard.scheduler.policies import PlacementView

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # SGLang's tree counts characters, llm-d estimates tokens from them: 4 a token


def role_of(worker: WorkerState) -> str:
    """The worker's role as a peer's deployment has it: a colocated worker beside decode
    workers (one ``switchyard`` may lend to decoding, ``scheduler.lending``) is a prefill
    worker there, since none of the peers' routers lends; it hands every decode over."""
    if worker.role == "both" and worker.fleet is not None and worker.fleet.decode:
        return "prefill"
    return worker.role


def requests_in_flight(worker: WorkerState) -> int:
    """Requests a worker holds for us: prefilling (its ledger) and, on a colocated worker,
    decoding (its KV claims)."""
    return len(worker.assigned) + len(worker.held)


def kv_usage(worker: WorkerState) -> float:
    """A share of the worker's KV memory in use, from our ledgers: a colocated worker's KV
    tokens (decoding and prefilling) over its KV capacity; a prefill worker, which reports
    no KV capacity, its prompt tokens in flight over its token budget."""
    if worker.kv_capacity > 0:
        return min(1.0, (worker.kv_tokens + worker.load_tokens) / worker.kv_capacity)
    return min(1.0, worker.load_tokens / max(1, worker.token_budget))


class BlockLru:
    """What a router believes each worker caches without asking it: the prompt blocks it
    sent there, the least recently sent dropped beyond ``capacity_tokens`` a worker.

    A prompt's keys are touched back to front, so a prefix is always more recent than its
    extensions and eviction takes tails first (the leaves of a radix tree)."""

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._held: dict[str, OrderedDict[int, None]] = {}

    def size(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))

    def match(self, worker_id: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` sent to the worker (chained keys: the first miss ends it)."""
        held = self._held.get(worker_id)
        if not held:
            return 0
        matched = 0
        for key in keys:
            if key not in held:
                break
            matched += 1
        return matched

    def insert(self, worker_id: str, keys: Sequence[int], block_size: int) -> None:
        held = self._held.setdefault(worker_id, OrderedDict())
        for key in reversed(keys):
            held[key] = None
            held.move_to_end(key)
        limit = max(1, self.capacity_tokens // max(1, block_size))
        while len(held) > limit:
            held.popitem(last=False)


class SglangCacheAware:
    """SGLang model gateway's ``cache_aware`` policy, with its defaults.

    From sgl-project/sglang ``sgl-model-gateway/src/policies/cache_aware.rs`` (before the
    rename: ``sgl-router/src/policies/cache_aware.rs``) and the defaults in
    ``sgl-model-gateway/bindings/python/src/sglang_router/router_args.py``:
    ``cache_threshold`` 0.3, ``balance_abs_threshold`` 64, ``balance_rel_threshold`` 1.5,
    ``max_tree_size`` 2**26 characters, ``eviction_interval_secs`` 60.

    1. Imbalanced (the most loaded candidate holds more than ``balance_abs`` requests in
       flight beyond the least loaded, and more than ``balance_rel`` times as many): the
       candidate with the fewest requests in flight. Requests, not tokens.
    2. Otherwise the candidate whose approximate tree matches the longest leading part of
       the prompt, if that covers more than ``cache_threshold`` of it;
    3. else the candidate with the smallest tree, the most cache room by that account
       (``Tree::get_smallest_tenant``).
    Whatever the branch, the prompt goes into the chosen worker's tree at once, at routing
    time: the next prompt with this prefix follows it before any KV event could tell.

    Deliberate differences:
    - The tree is a ``BlockLru`` of our chained block keys, not a character radix tree: a
      match counts whole blocks (a partial last block never matches), the match rate is
      matched block tokens / prompt tokens, a tree's size is its blocks.
    - Eviction happens on insertion beyond ``max_tree_size`` at 4 characters a token
      (2**24 tokens a worker: it never binds in our runs), not by a thread every 60 s.
    - In flight is our ledger: on a prefill worker a request counts until its prefill
      ends (the gateway counts until the whole response has streamed).
    - The balance test and the choice see only the candidates (workers within budget);
      the gateway tests all the model's workers.
    - Ties (their map's iteration order) go to the lowest worker id.
    - The newest ``cache_aware.rs`` we read (commit 053b63f) sends a miss to the least
      loaded worker instead of the smallest tree: ``miss="least_load"``.

    Decode workers (``choose_decode``): in PD mode the gateway picks the decode worker
    with its decode policy, which is the same ``cache_aware`` when none is given
    (``prefill_policy`` and ``decode_policy`` default to None: ``pd_router.rs``,
    ``router_args.py``), over the decode workers' own trees: the same three branches, with
    requests in flight counted on the decode worker (its decodes). The gateway picks both
    workers when the request arrives; here the decode worker is picked once the prefill is
    done, among those with room (the core's ledger).
    """

    name: ClassVar[str] = "sglang_cache_aware"
    argmin: ClassVar[bool] = False  # it compares candidates and records its choice
    slo_aware: ClassVar[bool] = False  # none of the peers queues by an SLO

    def __init__(
        self,
        cache_threshold: float = 0.3,
        balance_abs: int = 64,
        balance_rel: float = 1.5,
        max_tree_chars: int = 2**26,
        miss: Literal["smallest_tree", "least_load"] = "smallest_tree",
    ) -> None:
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self.miss = miss
        self.trees = BlockLru(capacity_tokens=max_tree_chars // CHARS_PER_TOKEN)

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        chosen = self._pick(request, candidates, view)
        self.trees.insert(chosen.worker_id, request.spec.block_keys, view.block_size)
        return chosen

    def choose_decode(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        """The decode worker, by the same policy over the decode workers (trees are per
        worker, so theirs are their own)."""
        return self.choose(request, candidates, view)

    def _pick(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        least = min(candidates, key=lambda w: (requests_in_flight(w), w.worker_id))
        low, high = requests_in_flight(least), max(requests_in_flight(w) for w in candidates)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            return least
        keys = request.spec.block_keys
        matched = {w.worker_id: self.trees.match(w.worker_id, keys) for w in candidates}
        best = min(candidates, key=lambda w: (-matched[w.worker_id], w.worker_id))
        rate = matched[best.worker_id] * view.block_size / request.prompt_tokens if request.prompt_tokens else 0.0
        if rate > self.cache_threshold:
            return best
        if self.miss == "least_load":
            return least
        return min(candidates, key=lambda w: (self.trees.size(w.worker_id), w.worker_id))


class DynamoKv:
    """Dynamo's KV router: one cost per worker, lower is better, the lowest wins.

    From ai-dynamo/dynamo ``lib/kv-router/src/scheduling/selector.rs``
    (``DefaultWorkerSelector``; older trees: ``lib/llm/src/kv_router/scheduler.rs``), the
    defaults in ``lib/kv-router/src/scheduling/config.rs`` (``overlap_score_weight`` 1.0,
    ``router_temperature`` 0: the minimum, no sampling) and the load it projects per
    worker (``potential_blocks_and_tokens`` in its ``sequence.rs``):

        logit          = overlap_weight * prefill_blocks + decode_blocks
        prefill_blocks = (prompt tokens routed there and not yet prefilled
                          + this prompt's tokens not cached there) / block_size
        decode_blocks  = distinct prompt blocks of the sequences active there
                         + this prompt's blocks not among them

    Cached means held on the worker's device tier, by our KV-event index (Dynamo's
    indexer is fed by the same kind of events). Its disaggregated prefill router turns
    active-block tracking off (``router_track_active_blocks = false``), so on a prefill
    worker decode_blocks is 0 and the prefill term decides; on a colocated (``both``)
    worker both count, as in Dynamo's aggregated mode.

    Deliberate differences:
    - Tokens not yet prefilled are our ledger (``load_tokens``: the uncached tokens placed
      there and not done), which Dynamo counts by the same rule in its own books.
    - Active sequences are this policy's record of what it routed, checked against each
      worker's ledger: a request stops counting when it leaves the worker. Requests placed
      without it (a session binding, a local prefill, one adopted after a failover) are
      not counted. Output blocks are not tracked (``router_track_output_blocks`` is off by
      default there too).
    - Ties (random among the minima in Dynamo) go to the lowest worker id.
    - The newer terms of ``selector.rs`` (overlap credit and its decay, host and disk hit
      weights, prefill load scale, an active-request weight) are not reproduced.

    Decode workers (``choose_decode``): in disaggregated serving Dynamo's frontend routes
    the request to a decode worker with this same KV router, active blocks tracked, over
    the decode workers' KV events (``docs/design_docs/disagg_serving.md``; the decode
    worker then has a prefill worker chosen): the lowest ``overlap_weight * blocks of the
    prompt not cached there + active blocks with this prompt's``, so a decode goes where
    its prompt already is unless that worker holds more active blocks than the transfer
    would cost. Dynamo routes the decode worker first, when the request arrives; here it
    is picked once the prefill is done, among the decode workers with room.
    """

    name: ClassVar[str] = "dynamo_kv"
    argmin: ClassVar[bool] = False  # it records what it routes: only committed choices
    slo_aware: ClassVar[bool] = False  # none of the peers queues by an SLO

    def __init__(self, overlap_weight: float = 1.0) -> None:
        self.overlap_weight = overlap_weight
        self._routed: dict[str, dict[str, Sequence[int]]] = {}  # worker -> request -> prompt block keys
        self._active: dict[str, dict[int, int]] = {}  # worker -> block key -> active sequences with it

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        for worker in candidates:
            self._forget_finished(worker)
        best = min(candidates, key=lambda w: (self.logit(w, request, view), w.worker_id))
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "dynamo_kv %s on %s = %.1f * %.3f prefill blocks + %d decode blocks",
                request.spec.request_id,
                best.worker_id,
                self.overlap_weight,
                self.prefill_blocks(best, request, view),
                self.decode_blocks(best, request),
            )
        if role_of(best) != "prefill":
            self._track(best, request)
        return best

    def choose_decode(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        for worker in candidates:
            self._forget_finished(worker)
        best = min(candidates, key=lambda w: (self.decode_logit(w, request, view), w.worker_id))
        self._track(best, request)
        return best

    def decode_logit(self, worker: WorkerState, request: Tracked, view: PlacementView) -> float:
        """On a decode worker: nothing is waiting to be prefilled there (its ledger holds
        the KV of its decodes), so the prefill term is the prompt's blocks it lacks."""
        prefill_blocks = self.lacking_tokens(worker, request, view) / view.block_size
        return self.overlap_weight * prefill_blocks + self.decode_blocks(worker, request)

    def logit(self, worker: WorkerState, request: Tracked, view: PlacementView) -> float:
        return self.overlap_weight * self.prefill_blocks(worker, request, view) + self.decode_blocks(worker, request)

    @classmethod
    def prefill_blocks(cls, worker: WorkerState, request: Tracked, view: PlacementView) -> float:
        return (worker.load_tokens + cls.lacking_tokens(worker, request, view)) / view.block_size

    @staticmethod
    def lacking_tokens(worker: WorkerState, request: Tracked, view: PlacementView) -> int:
        """The prompt's tokens the worker's device does not hold (Dynamo's new tokens)."""
        return max(0, request.prompt_tokens - view.device_blocks.get(worker.worker_id, 0) * view.block_size)

    def decode_blocks(self, worker: WorkerState, request: Tracked) -> int:
        if role_of(worker) == "prefill":
            return 0  # the disaggregated prefill router tracks no active blocks
        active = self._active.get(worker.worker_id, {})
        return len(active) + sum(1 for key in request.spec.block_keys if key not in active)

    def _track(self, worker: WorkerState, request: Tracked) -> None:
        routed = self._routed.setdefault(worker.worker_id, {})
        rid, keys = request.spec.request_id, request.spec.block_keys
        if rid in routed:
            return
        routed[rid] = keys
        active = self._active.setdefault(worker.worker_id, {})
        for key in keys:
            active[key] = active.get(key, 0) + 1

    def _forget_finished(self, worker: WorkerState) -> None:
        routed = self._routed.get(worker.worker_id)
        if not routed:
            return
        active = self._active[worker.worker_id]
        for rid in [r for r in routed if r not in worker.assigned and r not in worker.held]:
            for key in routed.pop(rid):
                if active[key] == 1:
                    del active[key]
                else:
                    active[key] -= 1


class Llmd:
    """llm-d's inference scheduler with its default profile: weighted scorers, the highest
    weighted sum wins.

    From llm-d/llm-d-inference-scheduler ``pkg/epp/config/loader/defaults.go`` (profile
    ``default``: ``prefix-cache-scorer`` weight 3, ``queue-scorer`` 2,
    ``kv-cache-utilization-scorer`` 2, then ``max-score-picker``) and the scorers under
    ``pkg/epp/framework/plugins/scheduling/scorer/`` (each README gives its formula):

        prefix = leading blocks of the prompt the worker holds / the prompt's blocks, from
                 an approximate index: each prompt's blocks recorded for the worker it was
                 sent to, at routing time; an LRU a worker of 31,250 16-token blocks
                 (``DefaultLRUCapacityPerServer``: 500,000 tokens)
        queue  = (max queue - its queue) / (max - min) over the candidates; 1 if all equal
        kv     = 1 - its KV cache usage

    Deliberate differences:
    - Queue is the requests placed there whose prefill is not done (our ledger, fresh);
      llm-d reads vLLM's waiting-queue size from scraped metrics (stale by a scrape, and
      without the requests already running).
    - KV cache usage is ``kv_usage`` (our ledgers); llm-d reads vLLM's usage metric.
    - The LRU's size is fixed (llm-d sizes it from the engine's block count when metrics
      report one) and counted in our block keys, not its character-estimated token blocks;
      the prompt is not truncated (its newest default caps matching at 131,072 tokens).
    - The max-score picker's ties (shuffled in llm-d) go to the lowest worker id.
    - Decode workers (``choose_decode``): with P/D, llm-d's decode pod is picked by this
      same profile (its ``pd-profile-handler`` runs the decode profile first, then the
      prefill one): the same scorers over the decode workers, the prefix index learning
      what it sends there. Their queue (vLLM's waiting requests) is empty here, since
      the core hands a decode only to a worker with room, so every decode worker's queue
      score is 1; KV usage is the decode ledger over its capacity. llm-d picks the decode
      pod when the request arrives; here it is picked once the prefill is done. Not
      reproduced: its ``decider``, which skips the prefill pod when most of the prompt is
      cached on the chosen decode pod (the P/D flow of llm-d's architecture docs): every request
      here is prefilled on a prefill worker.
    """

    name: ClassVar[str] = "llmd"
    argmin: ClassVar[bool] = False  # queue scores are normalised across the candidates
    slo_aware: ClassVar[bool] = False  # none of the peers queues by an SLO
    weights: ClassVar[tuple[float, float, float]] = (3.0, 2.0, 2.0)  # prefix, queue, kv

    def __init__(self) -> None:
        self.index = BlockLru(capacity_tokens=31_250 * 16)

    def choose(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        return self._pick(request, candidates, self.scores(request, candidates, view), view)

    def choose_decode(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> WorkerState:
        empty = dict.fromkeys((w.worker_id for w in candidates), 1.0)  # no decode pod has a queue
        return self._pick(request, candidates, self.scores(request, candidates, view, empty), view)

    def _pick(
        self, request: Tracked, candidates: list[WorkerState], scores: dict[str, float], view: PlacementView
    ) -> WorkerState:
        """The max-score picker (ties to the lowest id); the index learns the choice."""
        best = min(candidates, key=lambda w: (-scores[w.worker_id], w.worker_id))
        self.record(best, request, view)
        return best

    def record(self, worker: WorkerState, request: Tracked, view: PlacementView) -> None:
        """The approximate index learns at routing time (llm-d's ``PreRequest``)."""
        self.index.insert(worker.worker_id, request.spec.block_keys, view.block_size)

    def scores(
        self,
        request: Tracked,
        candidates: list[WorkerState],
        view: PlacementView,
        queue: dict[str, float] | None = None,
    ) -> dict[str, float]:
        """Each candidate's weighted sum; ``queue``: its queue scores, if not ``queue_scores``."""
        prefix = self.prefix_scores(request, candidates, view)
        queue = queue_scores(candidates) if queue is None else queue
        wp, wq, wk = self.weights
        return {
            w.worker_id: wp * prefix[w.worker_id] + wq * queue[w.worker_id] + wk * (1.0 - kv_usage(w))
            for w in candidates
        }

    def prefix_scores(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> dict[str, float]:
        keys = request.spec.block_keys
        return {w.worker_id: self.index.match(w.worker_id, keys) / len(keys) if keys else 0.0 for w in candidates}


class LlmdPrecise(Llmd):
    """llm-d's precise-prefix-cache profile: llm-d/llm-d-inference-scheduler
    ``deploy/config/epp-precise-prefix-cache-config.yaml`` (``precise-prefix-cache-scorer``
    weight 2, ``kv-cache-utilization-scorer`` 1, ``queue-scorer`` 1, ``max-score-picker``).

    The prefix scorer reads the engines' KV events instead of guessing: here the core's
    index (device tier). A worker's score is the leading blocks it holds, min-max
    normalised over the workers that hold any (1 when they all hold the same), 0 for the
    others (``indexedScoresToNormalizedScoredPods`` in ``scorer/preciseprefixcache``).
    Queue and KV usage as in ``Llmd``. Not reproduced: its speculative indexing (entries
    guessed at routing time until the events arrive) and per-tier weights.
    """

    name: ClassVar[str] = "llmd_precise"
    weights: ClassVar[tuple[float, float, float]] = (2.0, 1.0, 1.0)

    def record(self, worker: WorkerState, request: Tracked, view: PlacementView) -> None:
        pass  # the index learns from KV events only

    def prefix_scores(self, request: Tracked, candidates: list[WorkerState], view: PlacementView) -> dict[str, float]:
        held = {w.worker_id: view.device_blocks.get(w.worker_id, 0) for w in candidates}
        found = [n for n in held.values() if n > 0]
        if not found:
            return dict.fromkeys(held, 0.0)
        low, high = min(found), max(found)
        return {wid: (0.0 if n == 0 else 1.0 if high == low else (n - low) / (high - low)) for wid, n in held.items()}


def queue_scores(candidates: list[WorkerState]) -> dict[str, float]:
    """llm-d's queue scorer: the shortest queue 1, the longest 0, linear between; all 1 if
    every queue is the same length. A queue: requests placed there, prefill not done."""
    queues = {w.worker_id: len(w.assigned) for w in candidates}
    low, high = min(queues.values()), max(queues.values())
    if high == low:
        return dict.fromkeys(queues, 1.0)
    return {wid: (high - q) / (high - low) for wid, q in queues.items()}
