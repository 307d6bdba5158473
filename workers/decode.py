"""The decode role: continuous batching, one bus message per step per ingress.

Each engine step yields a token for every running sequence; the tokens are grouped
by the ingress that owns each request and sent as one ``StreamBatch`` per ingress,
which is what keeps the bus at hundreds of thousands of tokens per second instead of
tens of thousands with one message per token.

An engine that steps faster than ``min_publish_interval_s`` (1 ms by default; real
decode steps take 10-50 ms) shares one message among several steps, each request's
new tokens in one chunk: the bus and the ingress then see at most about a thousand
messages a second per ingress, however fast the engine. A finished sequence, and the
last step before the engine idles, are always sent at once.

A colocated worker (role ``both``) is this role with ``prefills``: it prefills and decodes
its own requests (``LocalTask``), and while the scheduler lends some colocated workers to
decoding it also prefills for them (``PrefillTask``: token 0 to the client, then
``PrefillDone`` with the KV handle once the KV can be found, as a prefill worker does) and,
lent, decodes what the others hand over (``DecodeTask``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup
from opentelemetry import trace
from opentelemetry.trace import Span

from switchyard.observability import tracing
from switchyard.schemas import (
    DecodeTask,
    FinishReason,
    LocalTask,
    PrefillDone,
    PrefillFailed,
    PrefillTask,
    RequestFinished,
    SharedBlocks,
    StreamChunk,
    StreamError,
    TokenLogprobs,
    WorkerTask,
)
from switchyard.workers.engine import DecodeEngine, PrefillResult, StepOutput
from switchyard.workers.handoff import announce, charged_tokens, first_token
from switchyard.workers.kv_events import KvCacheView, NoKvCache
from switchyard.workers.runtime import WorkerBus

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """One choice's tokens stepped and not yet sent."""

    seq: int  # output position of tokens[0]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # theirs, if asked for
    finished: FinishReason | None = None
    error: StreamError | None = None  # the engine refused the request (``StepOutput.refused``)


@dataclass(slots=True)
class _Stream:
    ingress_id: str
    span: Span
    choices: int = 1  # SamplingParams.n
    generated: int = 1  # token 0 came from prefill
    pending: dict[int, _Pending] = field(default_factory=dict)  # by choice
    ended: int = 0  # choices finished
    finished: FinishReason | None = None  # set once every choice has
    kv_expected_tokens: int = 0
    kv_loaded_tokens: int = 0
    first_step_at: float = 0.0  # when a step first gave it a token here
    last_step_at: float = 0.0
    steps: int = 0  # steps that gave it a token here (n choices step together)

    def stepped(self, now: float) -> None:
        if not self.steps:
            self.first_step_at = now
        self.last_step_at, self.steps = now, self.steps + 1

    def step_s(self) -> float:
        """Seconds a step, from its first token here to its last (``RequestFinished.step_s``)."""
        return (self.last_step_at - self.first_step_at) / (self.steps - 1) if self.steps > 1 else 0.0


class DecodeRole:
    def __init__(
        self,
        engine: DecodeEngine,
        worker_id: str,
        token_budget: int,
        min_publish_interval_s: float = 0.001,
        *,
        prefills: bool = False,
    ) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.token_budget = token_budget
        self.min_publish_interval_s = min_publish_interval_s
        self.prefills = prefills  # colocated: it also prefills for handoff (see the module's note)
        self._streams: dict[str, _Stream] = {}
        self._unsent: dict[str, _Stream] = {}  # streams with pending tokens, in step order
        self._last_publish = 0.0
        # Prefills not yet computed: its own (``LocalTask``) and, colocated, for handoff (``PrefillTask``).
        self._local: dict[str, tuple[LocalTask | PrefillTask, Span]] = {}
        self._wake = anyio.Event()
        self.kv_fallbacks = 0  # handed-over KV the engine did not find (it recomputed)
        self.handed_off = 0  # colocated: prefills whose KV it handed to a lent worker
        # The prompt blocks its decodes share, counted once, as the engine's prefix cache holds
        # them and as the scheduler's ledger counts them (``SharedBlocks``).
        # One count per block size (blocks of two sizes never match).
        self._shared: dict[int, SharedBlocks] = {}

    @property
    def kv_cache(self) -> KvCacheView:
        """Its prefix cache (filled by local prefills), as the runtime reports it."""
        return self.engine if isinstance(self.engine, KvCacheView) else NoKvCache()

    def inflight_tokens(self) -> int:
        """The KV its decodes hold, and the prompts queued for handoff."""
        return self.held_tokens() + sum(
            len(task.spec.prompt_tokens) for task, _ in self._local.values() if isinstance(task, PrefillTask)
        )

    def running(self) -> int:
        return self.engine.running

    def offer(self, task: WorkerTask, headers: dict[str, str]) -> str | None:
        if isinstance(task, LocalTask) or (self.prefills and isinstance(task, PrefillTask)):
            return self._offer_local(task, headers)
        if not isinstance(task, DecodeTask):
            return f"a decode worker takes no {type(task).__name__}"
        if task.spec.request_id in self._streams:  # a task delivered twice: one stream
            return "already decoding"
        if not self._has_room(task):
            return "no KV capacity"
        self._start(task, tracing.extract(headers))
        return None

    def _has_room(self, task: DecodeTask | LocalTask) -> bool:
        spec = task.spec
        shared = self._shared.get(spec.block_size)
        need = spec.sampling.kv_tokens(len(spec.prompt_tokens))
        if shared is not None:
            need -= shared.sharing(spec.block_keys)
        return not self.engine.running or self.held_tokens() + need <= self.token_budget

    def held_tokens(self) -> int:
        """The KV its decodes hold, each shared prompt block once."""
        return self.engine.held_tokens - sum(shared.saved for shared in self._shared.values())

    def _start(self, task: DecodeTask, ctx) -> None:
        spec = task.spec
        self._shared.setdefault(spec.block_size, SharedBlocks(spec.block_size)).add(spec.request_id, spec.block_keys)
        span = tracing.tracer().start_span("worker.decode", context=ctx)
        span.set_attribute("switchyard.worker_id", self.worker_id)
        self.engine.add(task)
        sampling = task.spec.sampling
        generated = 0 if sampling.decode_samples_first else 1  # token 0: prefill's, or ours
        self._streams[task.spec.request_id] = _Stream(
            task.spec.ingress_id, span, choices=sampling.n, generated=generated
        )
        self._wake.set()

    def _offer_local(self, task: LocalTask | PrefillTask, headers: dict[str, str]) -> str | None:
        """Prefill here, then decode here (``LocalTask``) or hand the KV off (``PrefillTask``):
        the next serve iteration computes it."""
        rid = task.spec.request_id
        if rid in self._streams or rid in self._local:  # a task delivered twice: one stream
            return "already decoding"
        if isinstance(task, LocalTask) and not self._has_room(task):  # a handoff's KV leaves with its decode
            return "no KV capacity"
        # As a prefill worker does: the scheduler keeps its prompts within the budget, so twice
        # the budget queued means its ledger is off (counted as it counts, the tokens it charged).
        queued = sum(charged_tokens(waiting) for waiting, _ in self._local.values())
        if queued and queued + charged_tokens(task) > 2 * self.token_budget:
            return "over token budget"
        name = "worker.local" if isinstance(task, LocalTask) else "worker.prefill"
        span = tracing.tracer().start_span(name, context=tracing.extract(headers))
        span.set_attribute("switchyard.worker_id", self.worker_id)
        self._local[task.spec.request_id] = (task, span)
        self._wake.set()
        return None

    def _unshare(self, request_id: str) -> None:
        for shared in self._shared.values():
            shared.remove(request_id)

    def cancel(self, request_id: str) -> None:
        local = self._local.pop(request_id, None)
        if local is not None:
            local[1].end()
        self._unshare(request_id)
        if self.engine.abort(request_id):
            stream = self._streams.pop(request_id)
            stream.span.set_attribute("switchyard.cancelled", True)
            stream.span.end()

    async def serve(self, bus: WorkerBus) -> None:
        async with anyio.create_task_group() as handoffs:
            await self._serve(bus, handoffs)

    async def _serve(self, bus: WorkerBus, handoffs: TaskGroup) -> None:
        while True:
            if not self.engine.running and not self._local:
                self._wake = anyio.Event()
                await self._wake.wait()
            if self._local:
                await self._prefill_local(bus, handoffs)
            # Blocks handed over or computed here since the last step, even with nothing to decode
            # (a colocated worker that only prefills for lent ones would otherwise never report them).
            await bus.kv_changes()
            if not self.engine.running:
                continue
            finished = self._absorb(await self.engine.step())
            now = time.monotonic()
            if finished or not self.engine.running or now - self._last_publish >= self.min_publish_interval_s:
                self._last_publish = now
                await self._publish(bus)

    async def _prefill_local(self, bus: WorkerBus, handoffs: TaskGroup) -> None:
        """Prefill every waiting task in one batch; token 0 out, then each local one into the
        decode batch and each handoff's ``PrefillDone`` out once its KV can be found: in
        ``handoffs``, so that this worker's own decodes keep stepping while the KV reaches
        the store (vLLM writes it after the output; ``HandoffEngine.wait_handoff``)."""
        jobs, self._local = list(self._local.values()), {}
        tasks = [
            task if isinstance(task, PrefillTask) else PrefillTask(spec=task.spec, queued_s=task.queued_s)
            for task, _ in jobs
        ]
        try:
            results = await self.engine.prefill(tasks)
        except Exception as exc:  # an engine failure fails these requests, not the worker
            log.exception("local prefill of %d failed", len(tasks))
            for task, span in jobs:
                span.end()
                await bus.event(
                    PrefillFailed(
                        worker_id=self.worker_id, request_id=task.spec.request_id, message=f"prefill failed: {exc}"
                    )
                )
            return
        handed: list[PrefillTask] = []  # and their results and PrefillDones, for ``announce``
        handed_results: list[PrefillResult] = []
        handed_done: list[PrefillDone] = []
        for (task, span), prefill, result in zip(jobs, tasks, results, strict=True):
            chunk, done = first_token(self.worker_id, prefill, result)
            span.set_attribute("switchyard.cached_tokens", result.cached_tokens)
            await bus.stream(task.spec.ingress_id, [chunk])
            if isinstance(task, PrefillTask):
                handed.append(task)
                handed_results.append(result)
                handed_done.append(done)
                span.end()
                continue
            await bus.event(done)
            if not done.finished:  # its room was checked when it was offered
                decode = DecodeTask(
                    spec=task.spec, handle=result.handle, first_token=result.first_token, usage=done.usage
                )
                self._start(decode, trace.set_span_in_context(span))
            span.end()
        # The client has its first token; the lent worker decodes once the KV can be found.
        if handed:
            handoffs.start_soon(announce, bus, self.engine, handed, handed_results, handed_done)
        self.handed_off += len(handed)

    def _absorb(self, outputs: list[StepOutput]) -> bool:
        """Queue each output token on its stream; True when a sequence finished."""
        finished, now = False, time.monotonic()
        stepped: set[str] = set()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # cancelled during the step
            pending = stream.pending.get(out.index)
            if pending is None:
                pending = stream.pending[out.index] = _Pending(out.position)
                self._unsent[out.request_id] = stream
            if out.token is not None:
                pending.tokens.append(out.token)
                stream.generated += 1
                if out.request_id not in stepped:
                    stepped.add(out.request_id)
                    stream.stepped(now)
                if out.logprobs is not None:
                    pending.logprobs.append(out.logprobs)
            if out.finished is not None:
                pending.finished = out.finished
                if out.refused is not None:
                    pending.error = StreamError(code="invalid_request", message=out.refused)
                stream.ended += 1
                if stream.ended < stream.choices:
                    continue
                stream.finished = out.finished
                stream.kv_expected_tokens, stream.kv_loaded_tokens = out.kv_expected_tokens, out.kv_loaded_tokens
                if out.kv_loaded_tokens < out.kv_expected_tokens:
                    self.kv_fallbacks += 1
                self._unshare(out.request_id)  # the engine released its KV in this step
                finished = True
        return finished

    async def _publish(self, bus: WorkerBus) -> None:
        by_ingress: dict[str, list[StreamChunk]] = {}
        done: list[RequestFinished] = []
        for rid, stream in self._unsent.items():
            if self._streams.get(rid) is not stream:
                continue  # cancelled since it stepped
            chunks = by_ingress.setdefault(stream.ingress_id, [])
            for index, pending in stream.pending.items():
                chunks.append(
                    StreamChunk(
                        request_id=rid,
                        seq=pending.seq,
                        token_ids=pending.tokens,
                        finish_reason=pending.finished,
                        logprobs=pending.logprobs or None,
                        error=pending.error,
                        index=index,
                    )
                )
            stream.pending = {}
            if stream.finished is not None:
                del self._streams[rid]
                stream.span.set_attribute("switchyard.generated_tokens", stream.generated)
                stream.span.end()
                done.append(
                    RequestFinished(
                        worker_id=self.worker_id,
                        request_id=rid,
                        generated_tokens=stream.generated,
                        reason=stream.finished,
                        kv_expected_tokens=stream.kv_expected_tokens,
                        kv_loaded_tokens=stream.kv_loaded_tokens,
                        step_s=stream.step_s(),
                    )
                )
        self._unsent = {}
        for ingress_id, chunks in by_ingress.items():
            await bus.stream(ingress_id, chunks)
        for event in done:
            await bus.event(event)
