"""The batch runner (``switchyard batch-runner``): runs batch lines in the fleet's troughs.

Any number of runners may run; they share the work through JetStream. Each batch in progress
has one durable pull consumer on the work-queue stream (filtered to the batch's subject:
explicit ack, ``ack_wait``, ``max_deliver``); a runner pulls one line at a time, from the batch
whose tenant was served least recently, then that tenant's least recently served batch
(``FairPicker``), so no tenant's big batch starves another's, and at most
``batch_concurrency`` lines of one batch at once.

**Headroom.** A line is pulled only while the scheduler's central queue holds at most
``headroom_queued_requests`` requests (with those paused after a worker refused them) and
``headroom_queued_tokens`` prompt tokens, and no prefilled request waits for decode room
(``has_headroom``; both 0 by default: an empty queue), read from ``ClusterStatus`` at most every
``status_interval_s`` and for at most ``pulls_per_status`` pulls. Work admitted this way runs
at batch priority (``x-switchyard-priority: batch``), so an interactive request that arrives
later still goes first in the queue; batch lines queue only when no interactive one does.

**One result per line.** A line runs as an HTTP request to the ingress (as its batch's tenant:
``x-switchyard-tenant`` with a trusted-proxy key). Its result is created in the results
bucket under (batch, custom_id), a create that fails when a result is there, and only then is
the line acked: a line redelivered (its runner died, or its ack was lost) finds its result and
is acked without running again, so it never gives a second line. A 429, a 5xx or no answer is
tried again (``nak`` with a growing delay) until ``max_deliver``; then the last answer, or a
``max_deliveries`` error, is its result. A line whose runner died on its last delivery is
caught by JetStream's max-deliveries advisory (and, should that be missed, by the sweep of an
idle batch): it becomes a ``max_deliveries`` error line, never a lost one.

**Ends.** When every line has a result the batch is ``finalizing``: one runner (compare-and-set)
writes the output and error files (``FileStore``, purpose ``batch_output``) and moves it to
``completed``, ``cancelled`` (it was cancelling: lines not run got ``batch_cancelled``, lines in
flight were cancelled, which cancels them on the workers) or ``expired`` (past its window:
lines not run got ``batch_expired``). Cancelled and expired lines are drained without headroom.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
import httpx
import msgspec
from anyio.abc import TaskGroup, TaskStatus
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js.errors import NotFoundError

from switchyard.ingress.auth import DEFAULT_TENANT, TENANT_HEADER
from switchyard.ingress.batch_config import BatchRunnerConfig
from switchyard.ingress.batch_lines import output_files
from switchyard.ingress.batch_store import BatchStore, now_s
from switchyard.ingress.batches import OUTPUT_PURPOSE, BatchMaker
from switchyard.ingress.errors import ApiError, IngressError
from switchyard.ingress.federation import REGION_HEADER
from switchyard.ingress.files import FileStore
from switchyard.observability import BusStats, connect, decoded, settle, subscribe
from switchyard.schemas import ClusterStatus, RegionSummary, StatusRequest, codec, subjects
from switchyard.schemas import batch as schema

log = logging.getLogger(__name__)

Mode = Literal["run", "cancel", "expire"]


class ServiceError(IngressError):
    """The batch runner cannot start as configured (its message says why)."""


_RETRY_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
_FETCH_TIMEOUT_S = 0.2
_STALE_FINALIZING_S = 60
_ABANDONED_VALIDATING_S = 600  # a batch is queued in seconds (10,000 lines: about one)
_IDLE_SCANS_BEFORE_SWEEP = 2
PRIORITY_HEADER = "x-switchyard-priority"
_REGION_DARK_S = 3.0  # another region's summaries older than this: not asked


def has_headroom(status: ClusterStatus | None, config: BatchRunnerConfig) -> bool:
    """Batch work may be added: the scheduler answers, its queue is (nearly) empty, and each
    role's workers keep ``headroom_free_budget`` of their token budgets free (a scheduler that
    does not say its workers' budgets is judged by its queue alone)."""
    if status is None:
        return False
    waiting = status.queued_requests + status.paused_requests  # paused: refused by a full worker
    if waiting > config.headroom_queued_requests or status.queued_tokens > config.headroom_queued_tokens:
        return False
    if status.awaiting_decode:  # prefilled requests wait for decode room: decode is full
        return False
    for role in ("prefill", "decode"):
        workers = [w for w in status.workers if w.role in (role, "both") and w.token_budget > 0]
        budget = sum(w.token_budget for w in workers)
        if budget and sum(w.inflight_tokens for w in workers) > (1 - config.headroom_free_budget) * budget:
            return False
    return True


def pick_region(
    home: ClusterStatus | None, others: list[tuple[str, ClusterStatus | None]], config: BatchRunnerConfig
) -> str | None:
    """Where the next lines run: "" (home) while it has headroom, else the first of ``others``
    (in the caller's order of preference) that has; None: nowhere."""
    if has_headroom(home, config):
        return ""
    return next((region for region, status in others if has_headroom(status, config)), None)


class FairPicker:
    """Least recently served tenant first, then its least recently served batch."""

    def __init__(self) -> None:
        self._turn = 0
        self._tenant_turn: dict[str, int] = {}
        self._batch_turn: dict[str, int] = {}

    def pick(self, ready: list[tuple[str, str]]) -> tuple[str, str] | None:
        """One of ``ready`` (tenant, batch id) pairs, and it counts as served."""
        if not ready:
            return None
        tenant = min({t for t, _ in ready}, key=lambda t: (self._tenant_turn.get(t, -1), t))
        batch = min((b for t, b in ready if t == tenant), key=lambda b: (self._batch_turn.get(b, -1), b))
        self._turn += 1
        self._tenant_turn[tenant] = self._batch_turn[batch] = self._turn
        return tenant, batch

    def forget(self, batch_id: str) -> None:
        self._batch_turn.pop(batch_id, None)


def mode_of(batch: schema.Batch, now: int) -> Mode:
    if batch.status == "cancelling":
        return "cancel"
    return "expire" if now >= batch.expires_at else "run"


def final_status(batch: schema.Batch, results: list[schema.LineResult]) -> Literal["completed", "cancelled", "expired"]:
    if batch.cancelling_at is not None:
        return "cancelled"
    if any(r.error is not None and r.error.code == "batch_expired" for r in results):
        return "expired"
    return "completed"


def finished(
    batch: schema.Batch, status: str, counts: schema.RequestCounts, output: str | None, errors: str | None
) -> schema.Batch:
    stamp = {f"{status}_at": now_s()}
    return msgspec.structs.replace(
        batch, status=status, request_counts=counts, output_file_id=output, error_file_id=errors, **stamp
    )


def counts_of(total: int, results: list[schema.LineResult]) -> schema.RequestCounts:
    ok = sum(r.ok for r in results)
    return schema.RequestCounts(total=total, completed=ok, failed=len(results) - ok)


@dataclass
class _Active:
    """A batch this runner pulls from."""

    batch: schema.Batch
    sub: Any  # JetStreamContext.PullSubscription
    in_flight: int = 0
    empty_until: float = 0.0  # monotonic: its consumer had nothing; asked again after
    idle_scans: int = 0
    scopes: set[anyio.CancelScope] = field(default_factory=set)
    finalizing: bool = False
    warm: bool = False  # a line of it has a result: its shared prefix is in some cache

    @property
    def mode(self) -> Mode:
        return mode_of(self.batch, now_s())

    def room(self, cap: int) -> bool:
        """One line at a time until the first has a result, so that the lines after it find the
        prefix they share (a system prompt) cached instead of all computing it at once."""
        return self.room_left(cap) > 0

    def room_left(self, cap: int) -> int:
        return (cap if self.warm or self.batch.request_counts.done else 1) - self.in_flight


class BatchRunner:
    def __init__(self, config: BatchRunnerConfig, *, transport: httpx.AsyncBaseTransport | None = None) -> None:
        """``transport``: how HTTP reaches the ingress (tests put a stand-in ingress there)."""
        if not config.runner_id:
            config = msgspec.structs.replace(config, runner_id=f"batch-runner-{uuid.uuid4().hex[:8]}")
        self.config = config
        self.stats = BusStats()
        self.picker = FairPicker()
        self._active: dict[str, _Active] = {}
        self._ended: set[str] = set()  # batch ids seen ended: their records never change again
        self._finalizing: set[str] = set()  # batches this runner moved to finalizing, not yet ended
        self._status: ClusterStatus | None = None
        self._status_at = -1.0
        self._pulls_left = 0
        self._target: str | None = None  # where the lines pulled on this status run ("": home)
        self._summaries: dict[str, tuple[float, RegionSummary]] = {}  # other regions', when heard
        self._remote_at = -1.0
        self._remote: list[tuple[str, ClusterStatus | None]] = []
        self.lines_run = 0  # results this runner stored (not counting ones already there)
        self._transport = transport
        self._api_key = _read_key(config.api_key_file)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        async with (
            connect(cfg.nats_url, cfg.runner_id, self.stats, cfg.nats_client) as nc,
            httpx.AsyncClient(
                base_url=cfg.ingress_url, timeout=cfg.request_timeout_s, transport=self._transport
            ) as http,
        ):
            self._nc, self._http = nc, http
            self.store = BatchStore(nc)
            self.files = FileStore(self.store.js, max_bytes=cfg.max_output_bytes)
            await self._open()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._scan_loop)
                tg.start_soon(
                    self._advisories,
                    await subscribe(nc, subjects.batch_max_deliveries(schema.WORK_STREAM), schema.RUNNER_QUEUE),
                )
                tg.start_soon(self._submits, await subscribe(nc, subjects.BATCH_SUBMIT, schema.RUNNER_QUEUE))
                if cfg.region:
                    tg.start_soon(self._hear_regions, await subscribe(nc, subjects.every_fed_summary()))
                await settle(nc)
                log.info("batch runner %s sending lines to %s", cfg.runner_id, cfg.ingress_url)
                task_status.started()
                await self._pull_loop(tg)

    async def _open(self) -> None:
        """The buckets and stream; JetStream may not be up yet (a stack starting): wait for it."""
        while True:
            try:
                await self.store.ensure()
                await self.files.ensure()
                return
            except ApiError as exc:
                log.warning("batch storage not ready: %s; retrying", exc)
                await anyio.sleep(1.0)

    # --- pulling ---------------------------------------------------------------------------------

    async def _pull_loop(self, tg: TaskGroup) -> None:
        slots = anyio.Semaphore(self.config.max_in_flight)
        while True:
            await slots.acquire()
            try:
                active, msgs = await self._next_lines(spare=slots.value)
            except BaseException:
                slots.release()
                raise
            region = self._target or ""
            for i, msg in enumerate(msgs):
                if i:  # the first took the slot acquired above; _next_lines fetched no more than are free
                    slots.acquire_nowait()
                active.in_flight += 1
                tg.start_soon(self._execute, active, msg, slots, region)

    async def _next_lines(self, spare: int) -> tuple[_Active, list[Msg]]:
        """Lines of one batch: at least one, and up to ``spare`` more (free slots, the batch's
        room, the pulls the last status allows), fetched in one pull request."""
        while True:
            now = time.monotonic()
            ready = [
                a
                for a in self._active.values()
                if not a.finalizing
                and a.batch.status != "finalizing"
                and a.empty_until <= now
                and a.room(self.config.batch_concurrency)
            ]
            draining = [a for a in ready if a.mode != "run"]  # dropped, not run: no headroom needed
            if not draining and ready and not await self._headroom():
                await anyio.sleep(self.config.status_interval_s)
                continue
            # By object, not by id: the scan may have dropped a batch while the status was read
            # (a fetch from its closed subscription then fails like any other, below).
            candidates = {a.batch.id: a for a in (draining or ready)}
            choice = self.picker.pick([(a.batch.tenant, a.batch.id) for a in candidates.values()])
            if choice is None:
                await anyio.sleep(self.config.status_interval_s)
                continue
            active = candidates[choice[1]]
            want = 1 + max(0, min(spare, active.room_left(self.config.batch_concurrency) - 1))
            if not draining:
                want = min(want, max(1, self._pulls_left))
            try:
                msgs = await active.sub.fetch(want, timeout=_FETCH_TIMEOUT_S)
            except NatsTimeout:
                active.empty_until = time.monotonic() + self.config.scan_interval_s
                continue
            except Exception as exc:  # the consumer was deleted (batch ended), NATS away: next scan
                log.debug("fetch from %s: %r", active.batch.id, exc)
                active.empty_until = time.monotonic() + self.config.scan_interval_s
                continue
            if not draining:
                self._pulls_left -= len(msgs)
            return active, msgs

    async def _headroom(self) -> bool:
        stale = time.monotonic() - self._status_at >= self.config.status_interval_s
        if stale or self._pulls_left <= 0:
            self._status = await self._cluster_status()
            self._target = pick_region(self._status, await self._other_regions(), self.config)
            self._status_at = time.monotonic()
            self._pulls_left = self.config.pulls_per_status
        return self._pulls_left > 0 and self._target is not None

    async def _other_regions(self) -> list[tuple[str, ClusterStatus | None]]:
        """Federated, while home has no headroom: the other live regions' statuses (read every
        ``remote_status_interval_s``), the least queued by their summaries first."""
        if not self.config.region or has_headroom(self._status, self.config):
            return []
        now = time.monotonic()
        if now - self._remote_at >= self.config.remote_status_interval_s:
            self._remote_at = now
            live = [(s.predicted_wait_s, r) for r, (at, s) in self._summaries.items() if now - at < _REGION_DARK_S]
            self._remote = [
                (region, await self._cluster_status(subjects.to_region(region, "submit")))
                for _, region in sorted(live)
                if not self._summaries[region][1].saturated
            ]
        return self._remote

    async def _hear_regions(self, sub) -> None:
        async for _, summary in decoded(sub, codec.REGION_SUMMARY, "region summary"):
            if summary.region != self.config.region:
                self._summaries[summary.region] = (time.monotonic(), summary)

    async def _cluster_status(self, subject: str = subjects.SUBMIT) -> ClusterStatus | None:
        try:
            reply = await self._nc.request(subject, codec.SCHEDULER_REQUEST.encode(StatusRequest()), timeout=1.0)
        except (NoRespondersError, NatsTimeout):
            return None
        status = codec.SCHEDULER_REPLY.decode(reply.data)
        return status if isinstance(status, ClusterStatus) else None

    # --- one line --------------------------------------------------------------------------------

    async def _execute(self, active: _Active, msg: Msg, slots: anyio.Semaphore, region: str = "") -> None:
        try:
            item = schema.WORK_ITEM.decode(msg.data)
        except msgspec.DecodeError:
            log.error("undecodable work item on %s: dropped", msg.subject)
            await msg.term()
            active.in_flight -= 1
            slots.release()
            return
        try:
            with anyio.CancelScope() as scope:
                active.scopes.add(scope)
                await self._run_line(active, item, msg, region)
            if scope.cancelled_caught:  # its batch was cancelled while it ran
                await self._settle(item, msg, _dropped(item, "cancel"))
        except Exception:
            log.exception("line %d of %s: left for redelivery", item.line, item.batch_id)
        finally:
            active.scopes.discard(scope)
            active.in_flight -= 1
            slots.release()

    async def _run_line(self, active: _Active, item: schema.WorkItem, msg: Msg, region: str = "") -> None:
        if await self.store.has_result(item.batch_id, item.custom_id):
            await msg.ack()  # run before; its ack was lost or its runner died after storing
            return
        mode = active.mode
        if mode != "run":
            await self._settle(item, msg, _dropped(item, mode))
            return
        result = await self._post(item, msg, region)
        if result is not None:
            await self._settle(item, msg, result)

    async def _post(self, item: schema.WorkItem, msg: Msg, region: str = "") -> schema.LineResult | None:
        """The line's result, or None when it was handed back to run again (``nak``); run in
        ``region`` when one is named (another region's headroom)."""
        delivered = msg.metadata.num_delivered
        response: httpx.Response | None = None
        why = ""
        async with anyio.create_task_group() as beat:
            beat.start_soon(_keep_in_progress, msg, self.config.ack_wait_s / 3)
            try:
                headers = self._headers(item.tenant) | ({REGION_HEADER: region} if region else {})
                response = await self._http.post(item.endpoint, content=item.body, headers=headers)
            except httpx.HTTPError as exc:
                why = f"{type(exc).__name__}: {exc}"
            beat.cancel_scope.cancel()
        retry = response is None or response.status_code in _RETRY_STATUSES
        if retry and delivered < self.config.max_deliver:
            delay = self.config.retry_delay_s * 2 ** (delivered - 1)
            log.info("line %d of %s: %s; again in %.1f s", item.line, item.batch_id, why or response, delay)
            await msg.nak(delay=delay)
            return None
        if response is None:
            return _error(item, "max_deliveries", f"No answer after {delivered} deliveries: {why}")
        return schema.LineResult(
            batch_id=item.batch_id,
            custom_id=item.custom_id,
            line=item.line,
            status_code=response.status_code,
            body=response.text,
            request_id=_response_id(response),
        )

    def _headers(self, tenant: str) -> dict[str, str]:
        headers = {PRIORITY_HEADER: "batch", "content-type": "application/json"}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        if self._api_key or tenant != DEFAULT_TENANT:
            headers[TENANT_HEADER] = tenant
        return headers

    async def _settle(self, item: schema.WorkItem, msg: Msg | None, result: schema.LineResult) -> None:
        """Store the result (unless the line has one), count it, then ack the line."""
        with anyio.CancelScope(shield=True):
            await self._store_result(result)
            if msg is not None:
                await msg.ack()

    async def _store_result(self, result: schema.LineResult) -> None:
        if not await self.store.put_result(result):
            return
        self.lines_run += 1
        active = self._active.get(result.batch_id)
        if active is not None:
            active.warm = True
        batch = await self.store.count(result)
        if batch is not None and batch.request_counts.done >= batch.request_counts.total:
            self._tg.start_soon(self._finalize, batch.id)

    # --- lines out of deliveries -----------------------------------------------------------------

    async def _advisories(self, sub) -> None:
        """JetStream's max-deliveries advisory names a line no runner acked in time on its last
        delivery (its runner died): it becomes an error line and leaves the queue."""
        async for msg in sub.messages:
            try:
                seq = int(msgspec.json.decode(msg.data)["stream_seq"])
                await self._give_up(seq)
            except Exception:
                log.exception("max-deliveries advisory %r", msg.data[:200])

    async def _give_up(self, seq: int) -> None:
        try:
            raw = await self.store.js.get_msg(schema.WORK_STREAM, seq=seq)
        except NotFoundError:
            return  # acked or swept meanwhile
        assert raw.data is not None
        item = schema.WORK_ITEM.decode(raw.data)
        message = f"The line was delivered {self.config.max_deliver} times and never finished."
        await self._settle(item, None, _error(item, "max_deliveries", message))
        try:
            await self.store.js.delete_msg(schema.WORK_STREAM, seq)
        except NotFoundError:
            pass
        log.warning("line %d of %s: out of deliveries, an error line", item.line, item.batch_id)

    async def _abandon(self, batch: schema.Batch) -> None:
        """A batch left ``validating`` (its ingress died while it queued the lines: nobody knows
        whether all of them are there): it fails, and what it queued is removed."""
        error = schema.BatchError(
            code="validation_interrupted",
            message="The batch was not fully queued (its ingress stopped); submit it again.",
        )

        def fail(b: schema.Batch) -> schema.Batch | None:
            if b.status != "validating":
                return None
            return msgspec.structs.replace(
                b, status="failed", failed_at=now_s(), errors=schema.BatchErrors(data=[error])
            )

        if await self.store.update(batch.id, fail) is None:
            return
        await self._remove_lines(batch)
        log.warning("batch %s was left validating: failed, its queued lines removed", batch.id)

    async def _lines_left(self, batch: schema.Batch) -> AsyncIterator[int]:
        """The stream sequence of each of the batch's lines still on the work queue, in order."""
        subject, seq = subjects.batch_work(batch.tenant, batch.id), 1
        while True:
            try:
                raw = await self.store.js.get_msg(schema.WORK_STREAM, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return
            assert raw.seq is not None
            yield raw.seq
            seq = raw.seq + 1

    async def _remove_lines(self, batch: schema.Batch) -> None:
        """Whatever of the batch is left on the work queue (no consumer holds it any more)."""
        async for seq in self._lines_left(batch):
            with contextlib.suppress(NotFoundError):
                await self.store.js.delete_msg(schema.WORK_STREAM, seq)

    async def _sweep(self, batch: schema.Batch) -> None:
        """What is left of an idle batch's lines on the stream (nothing pending nor in flight):
        lines whose advisory was missed."""
        async for seq in self._lines_left(batch):
            await self._give_up(seq)

    # --- the batch records ----------------------------------------------------------------------

    async def _scan_loop(self) -> None:
        while True:
            try:
                await self._scan()
            except Exception:
                log.exception("scanning the batch records")
            await anyio.sleep(self.config.scan_interval_s)

    async def _scan(self) -> None:
        seen: set[str] = set()
        for batch in await self.store.all(skip=self._ended):
            if batch.terminal:
                self._ended.add(batch.id)
            if batch.status == "validating" and now_s() - batch.created_at >= _ABANDONED_VALIDATING_S:
                await self._abandon(batch)
                continue
            if batch.status not in ("in_progress", "cancelling", "finalizing"):
                continue
            seen.add(batch.id)
            await self._track(batch)
        for gone in set(self._active) - seen:
            ended = self._active.pop(gone)
            self.picker.forget(gone)
            with anyio.CancelScope(shield=True):
                await ended.sub.unsubscribe()

    async def _track(self, batch: schema.Batch) -> None:
        active = self._active.get(batch.id)
        if active is not None:
            active.batch = batch
        if batch.status == "finalizing":  # every line has its result: nothing to pull
            # Its finalizer died (another runner), or this runner's attempt failed: again.
            if batch.id in self._finalizing or now_s() - (batch.finalizing_at or 0) >= _STALE_FINALIZING_S:
                self._tg.start_soon(self._finalize, batch.id)
            return
        if active is None:
            sub = await self.store.js.pull_subscribe(
                subjects.batch_work(batch.tenant, batch.id),
                durable=BatchStore.consumer_name(batch.id),
                stream=schema.WORK_STREAM,
                config=BatchStore.consumer_config(
                    batch, ack_wait_s=self.config.ack_wait_s, max_deliver=self.config.max_deliver
                ),
            )
            active = self._active[batch.id] = _Active(batch, sub)
        active.batch = batch
        active.empty_until = 0.0
        if active.mode == "cancel":
            for scope in list(active.scopes):
                scope.cancel()
        if batch.request_counts.done >= batch.request_counts.total:
            self._tg.start_soon(self._finalize, batch.id)
            return
        await self._check_idle(active)

    async def _check_idle(self, active: _Active) -> None:
        """A batch with nothing pending, in flight or unacked, and lines without results: its
        counts lost a result (a runner died between storing and counting), or lines are out of
        deliveries and their advisory was missed."""
        info = await self.store.js.consumer_info(schema.WORK_STREAM, BatchStore.consumer_name(active.batch.id))
        idle = info.num_pending == 0 and info.num_ack_pending == 0 and active.in_flight == 0
        active.idle_scans = active.idle_scans + 1 if idle else 0
        if active.idle_scans < _IDLE_SCANS_BEFORE_SWEEP:
            return
        counts = await self.store.recount(active.batch.id)
        if counts != active.batch.request_counts:
            await self.store.update(active.batch.id, lambda b: msgspec.structs.replace(b, request_counts=counts))
        if counts.done < counts.total:
            await self._sweep(active.batch)
        else:
            self._tg.start_soon(self._finalize, active.batch.id)

    async def _finalize(self, batch_id: str) -> None:
        active = self._active.get(batch_id)
        if active is not None and active.finalizing:
            return
        if active is not None:
            active.finalizing = True
        try:
            await self._write_outputs(batch_id)
        except Exception:
            log.exception("finalizing %s (a later scan tries again)", batch_id)
        finally:
            if active is not None:
                active.finalizing = False

    async def _write_outputs(self, batch_id: str) -> None:
        stale = now_s() - _STALE_FINALIZING_S

        def begin(b: schema.Batch) -> schema.Batch | None:
            if b.status in ("in_progress", "cancelling") and b.request_counts.done >= b.request_counts.total:
                return msgspec.structs.replace(b, status="finalizing", finalizing_at=now_s())
            if b.status == "finalizing" and (b.finalizing_at or 0) <= stale:  # taken over from a dead runner
                return msgspec.structs.replace(b, finalizing_at=now_s())
            return None

        batch = await self.store.update(batch_id, begin)
        if batch is None and batch_id in self._finalizing:  # this runner's own, tried before
            batch = await self.store.get(batch_id)
        if batch is None or batch.status != "finalizing":
            self._finalizing.discard(batch_id)
            return  # not done yet, or another runner finalizes it
        self._finalizing.add(batch_id)
        results = await self.store.results_of(batch_id)
        counts = counts_of(batch.request_counts.total, results)
        ok, failed = output_files(results)
        output = await self._put_file(batch, "output", ok)
        errors = await self._put_file(batch, "errors", failed)
        status = final_status(batch, results)
        # Every line has its result: a line still on the queue is one whose result was stored and
        # whose ack was not (its runner died in between). It goes with the batch's consumer.
        await self.store.drop_consumer(batch_id)
        await self._remove_lines(batch)
        done = await self.store.update(
            batch_id, lambda b: finished(b, status, counts, output, errors) if b.status == "finalizing" else None
        )
        self._finalizing.discard(batch_id)
        if done is not None:
            log.info("batch %s %s: %d completed, %d failed", batch_id, status, counts.completed, counts.failed)

    async def _put_file(self, batch: schema.Batch, kind: str, data: bytes) -> str | None:
        """One of the batch's files (none for no lines): its id."""
        if not data:
            return None
        file = await self.files.put(f"{batch.id}_{kind}.jsonl", OUTPUT_PURPOSE, data, tenant=batch.tenant)
        return file.id

    # --- the bus-native path ---------------------------------------------------------------------

    async def _submits(self, sub) -> None:
        """``JobSubmit`` -> ``JobReply``: one job or many, as one batch of the same machinery."""
        maker: BatchMaker | None = None
        async for msg in sub.messages:
            try:
                maker = maker or BatchMaker(self.store, await self._served_model())
                reply = await _submit(maker, msg.data)
            except Exception as exc:
                log.exception("job submit")
                reply = schema.JobRejected(errors=[schema.BatchError(code="internal_error", message=repr(exc))])
            if msg.reply:
                await msg.respond(schema.encode(reply))

    async def _served_model(self) -> str:
        headers = {"authorization": f"Bearer {self._api_key}"} if self._api_key else {}
        response = await self._http.get("/v1/models", headers=headers, timeout=10.0)
        response.raise_for_status()
        return str(response.json()["data"][0]["id"])


async def _submit(maker: BatchMaker, data: bytes) -> schema.JobAccepted | schema.JobRejected:
    try:
        submit = schema.JOB_SUBMIT.decode(data)
        maker.check_request(submit.endpoint, submit.completion_window, submit.metadata)
    except (msgspec.DecodeError, ApiError) as exc:
        return schema.JobRejected(
            errors=[schema.BatchError(code="invalid_request", message=str(exc), param=getattr(exc, "param", None))]
        )
    lines = b"".join(
        msgspec.json.encode({"custom_id": j.custom_id, "method": "POST", "url": submit.endpoint, "body": j.body})
        + b"\n"
        for j in submit.jobs
    )
    batch = await maker.create(
        tenant=submit.tenant,
        endpoint=submit.endpoint,
        window=submit.completion_window,
        metadata=submit.metadata,
        input_file_id=None,
        data=lines,
    )
    if batch.status == "failed":
        return schema.JobRejected(errors=batch.errors.data if batch.errors else [])
    return schema.JobAccepted(batch=batch)


def _read_key(path: str) -> str:
    """The API key in ``path`` (none: no key); read at start, so a bad path stops it at once."""
    if not path:
        return ""
    try:
        return Path(path).read_text().strip()
    except OSError as exc:
        raise ServiceError(f"api-key-file {path}: {exc.strerror}") from None


async def _keep_in_progress(msg: Msg, every_s: float) -> None:
    """While a line runs, its delivery is kept (ack_wait restarts): a long line is not redelivered."""
    while True:
        await anyio.sleep(every_s)
        await msg.in_progress()


def _dropped(item: schema.WorkItem, mode: Mode) -> schema.LineResult:
    if mode == "cancel":
        return _error(item, "batch_cancelled", "The batch was cancelled before this request finished.")
    return _error(item, "batch_expired", "The batch expired before this request could run.")


def _error(item: schema.WorkItem, code: str, message: str) -> schema.LineResult:
    return schema.LineResult(
        batch_id=item.batch_id,
        custom_id=item.custom_id,
        line=item.line,
        error=schema.LineError(code=code, message=message),
    )


def _response_id(response: httpx.Response) -> str | None:
    """The completion's id; for an answer without one (an error), the response's x-request-id."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if isinstance(body, dict) and isinstance(body.get("id"), str):
        return str(body["id"])
    return response.headers.get("x-request-id")
