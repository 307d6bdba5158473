"""The prefill role: batch what is queued, compute it, hand the KV off.

For each request it streams token 0 (with the prompt usage: prompt and cached tokens)
straight to the request's ingress, then tells the scheduler ``PrefillDone`` with the
KV handle so that a decode worker can continue at token 1. After each batch it
publishes what the batch changed in the engine's prefix cache (one ``KvEventBatch``,
when anything changed) for the scheduler's prefix index.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

import anyio
from opentelemetry.trace import Span

from switchyard.observability import tracing
from switchyard.schemas import PrefillDone, PrefillFailed, PrefillTask, StreamChunk, WorkerTask
from switchyard.workers.engine import PrefillEngine, PrefillResult
from switchyard.workers.handoff import announce, charged_tokens, first_token
from switchyard.workers.kv_events import KvCacheView, NoKvCache
from switchyard.workers.runtime import WorkerBus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    task: PrefillTask
    span: Span


class PrefillRole:
    def __init__(self, engine: PrefillEngine, worker_id: str, token_budget: int) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.token_budget = token_budget
        self._queue: deque[_Job] = deque()
        self._active: dict[str, _Job] = {}  # queued or computing, by request id
        self._tokens = 0
        self._wake = anyio.Event()

    @property
    def kv_cache(self) -> KvCacheView:
        """The engine's prefix cache, as the runtime reports it (see ``workers.kv_events``)."""
        return self.engine if isinstance(self.engine, KvCacheView) else NoKvCache()

    @property
    def kv_fallbacks(self) -> int:
        """None: a prefill loads no handed-over KV, so it has none to miss."""
        return 0

    def inflight_tokens(self) -> int:
        return self._tokens

    def running(self) -> int:
        return len(self._active)

    def offer(self, task: WorkerTask, headers: dict[str, str]) -> str | None:
        if not isinstance(task, PrefillTask):
            return f"a prefill worker takes no {type(task).__name__}"
        tokens = charged_tokens(task)
        # The scheduler keeps within budget; twice the budget means its ledger is off. Counted
        # as it counts (the uncached tokens it charged), or cached prompts look like overload.
        if self._tokens and self._tokens + tokens > 2 * self.token_budget:
            return "over token budget"
        span = tracing.tracer().start_span("worker.prefill", context=tracing.extract(headers))
        span.set_attribute("switchyard.worker_id", self.worker_id)
        job = _Job(task, span)
        self._queue.append(job)
        self._active[task.spec.request_id] = job
        self._tokens += tokens
        self._wake.set()
        return None

    def cancel(self, request_id: str) -> None:
        job = self._active.pop(request_id, None)
        if job is None:
            return
        self._tokens -= charged_tokens(job.task)
        job.span.set_attribute("switchyard.cancelled", True)
        job.span.end()
        if job in self._queue:
            self._queue.remove(job)

    async def serve(self, bus: WorkerBus) -> None:
        while True:
            while not self._queue:  # a wake-up can find it empty: a cancel took the job meanwhile
                self._wake = anyio.Event()
                await self._wake.wait()
            await self._compute(bus, self._take_batch())
            await bus.kv_changes()  # whatever the batch left in the cache, even if it failed

    async def _compute(self, bus: WorkerBus, batch: list[_Job]) -> None:
        try:
            results = await self.engine.prefill([job.task for job in batch])
        except Exception as exc:  # an engine failure fails its batch, not the worker
            log.exception("prefill batch of %d failed", len(batch))
            await self._fail(bus, batch, f"prefill failed: {exc}")
            return
        await self._publish(bus, batch, results)

    def _take_batch(self) -> list[_Job]:
        batch = [self._queue.popleft()]
        tokens = len(batch[0].task.spec.prompt_tokens)
        while self._queue:
            nxt = len(self._queue[0].task.spec.prompt_tokens)
            if tokens + nxt > self.token_budget:
                break
            batch.append(self._queue.popleft())
            tokens += nxt
        return batch

    async def _publish(self, bus: WorkerBus, batch: list[_Job], results: list[PrefillResult]) -> None:
        by_ingress: dict[str, list[StreamChunk]] = {}
        done: list[PrefillDone] = []
        for job, result in zip(batch, results, strict=True):
            spec = job.task.spec
            if self._active.pop(spec.request_id, None) is None:
                continue  # cancelled while computing
            self._tokens -= charged_tokens(job.task)
            chunk, prefilled = first_token(self.worker_id, job.task, result)
            by_ingress.setdefault(spec.ingress_id, []).append(chunk)
            done.append(prefilled)
            job.span.set_attribute("switchyard.cached_tokens", result.cached_tokens)
            job.span.end()
        # Token 0 reaches the ingress before the scheduler can start decode (same connection).
        for ingress_id, chunks in by_ingress.items():
            await bus.stream(ingress_id, chunks)
        # The client has its first token; decode starts once the KV can be found.
        await announce(bus, self.engine, [job.task for job in batch], results, done)

    async def _fail(self, bus: WorkerBus, batch: list[_Job], message: str) -> None:
        for job in batch:
            rid = job.task.spec.request_id
            if self._active.pop(rid, None) is None:
                continue
            self._tokens -= charged_tokens(job.task)
            job.span.record_exception(RuntimeError(message))
            job.span.end()
            await bus.event(PrefillFailed(worker_id=self.worker_id, request_id=rid, message=message))
