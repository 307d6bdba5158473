"""The ``vllm`` engine: vLLM's async engine in the worker's process, behind the same
``PrefillEngine`` / ``DecodeEngine`` interface as the sim engine.

Prefill runs each request with ``max_tokens=1``: vLLM batches what is submitted
together, its KV connector saves the prompt's whole blocks (``workers.vllm_config``),
and the first token with the engine's own cached-token count goes to the client. The
handle names the transfer kind; for NIXL it carries the engine's transfer params.

Decode continues from the prompt plus that first token (never sampling a second first
token): the engine finds the prompt's blocks through its connector and computes only
the tail. Whether the KV arrived is read from the engine, not assumed: the first
output's ``num_cached_tokens`` is the prompt tokens it did not compute. Fewer than the
handle's whole blocks means the load failed and the engine recomputed: the step output
says so, the decode worker reports it, and a warning is logged.

Tokens stream out as vLLM yields them: each request's generator feeds one list that
``step`` drains, so the decode role publishes whatever every sequence produced since
its last publish, in one bus message per ingress.

The engine lives inside ``serving()``, entered by the worker's ``run()`` around
everything else it does: it boots vLLM, and keeps the engine's own tasks (the KV-event
bridge, one task per decoding request, each in its own cancel scope) in one anyio task
group. A task that dies takes the worker down with ``EngineError``; one request that
fails in vLLM fails only itself, unless vLLM says the engine is dead. vLLM's
``AsyncLLM`` is asyncio-based; anyio runs on asyncio, so it runs within the group.

The engine's KV-cache events (stored, removed, cleared) arrive over ZMQ from the engine
core process; ``VllmKvEvents`` turns vLLM's block hashes into the bus's block keys
(``kvbus.keys.key_of_digest``) and keeps the set of blocks held, for snapshots.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import anyio
from anyio.abc import TaskGroup, TaskStatus

from switchyard.kvbus import cache_salt_for, key_of_digest, vllm_block_hashes
from switchyard.schemas import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    DecodeTask,
    FinishReason,
    KvEvent,
    LmcacheKvHandle,
    MooncakeStoreKvHandle,
    NixlKvHandle,
    PrefillTask,
    RequestSpec,
    StructuredOutput,
    Tier,
    TokenLogprobs,
)
from switchyard.workers.engine import PrefillResult, StepOutput
from switchyard.workers.errors import EngineError
from switchyard.workers.vllm_config import VllmEngineConfig

log = logging.getLogger(__name__)

_FINISH: dict[str | None, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}


@dataclass
class EngineCounters:
    """What the engine's own stats say, summed since boot (read by tests and ``/metrics``)."""

    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens the engine prefilled itself
    local_cache_hit_tokens: int = 0  # found in its own prefix cache
    external_hit_tokens: int = 0  # loaded through the KV connector
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    def wire(self) -> dict[str, int]:
        """The fields ``schemas.EngineStats`` carries."""
        return dict(self.__dict__)


def _stat_logger_factory(counters: EngineCounters):
    """A vLLM stat logger that adds each iteration's figures to ``counters``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Logger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if iteration_stats is not None:
                prompt = iteration_stats.prompt_token_stats
                counters.prompt_tokens += prompt.total
                counters.computed_tokens += prompt.computed
                counters.local_cache_hit_tokens += prompt.local_cache_hit
                counters.external_hit_tokens += prompt.external_kv_transfer
            spec = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec is not None:
                counters.spec_drafts += spec.num_drafts
                counters.spec_draft_tokens += spec.num_draft_tokens
                counters.spec_accepted_tokens += spec.num_accepted_tokens

        def log_engine_initialized(self) -> None:
            pass

    return _Logger


class VllmKvEvents:
    """The engine's KV-cache events, bridged from its ZMQ publisher: ``KvCacheView``.

    vLLM's own block pool reports its device cache (medium ``GPU``, on CPU hosts too); a
    KV connector reports what it finished writing to its store (MooncakeStoreConnector:
    medium ``cpu``, after the put succeeded). The first are the ``device`` tier, the
    second the ``cluster`` tier: blocks any engine of the model can load.
    """

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self._held: dict[Tier, set[int]] = {}
        self._events: list[KvEvent] = []
        self._changed = anyio.Event()  # set while changes wait to be taken
        self._stored = anyio.Event()  # set, then replaced, on every batch: wakes ``wait_stored``
        self.last_seq = -1

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return {tier: list(keys) for tier, keys in self._held.items() if keys}

    def holds(self, tier: Tier, keys: list[int]) -> bool:
        return set(keys) <= self._held.get(tier, set())

    async def wait_stored(self, tier: Tier, keys: list[int], timeout_s: float) -> bool:
        """True once every key is reported stored in ``tier``; False after ``timeout_s``."""
        with anyio.move_on_after(timeout_s):
            while not self.holds(tier, keys):
                await self._stored.wait()
        return self.holds(tier, keys)

    async def wait_changes(self) -> None:
        """Returns when there are changes not yet taken."""
        while not self._events:
            await self._changed.wait()

    def take_kv_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        if self._changed.is_set():  # set only with changes pending: none are now
            self._changed = anyio.Event()
        return events

    def apply(self, batch: Any) -> None:
        """One of vLLM's ``KVEventBatch``es, in our terms."""
        from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
        from vllm.distributed.kv_events import BlockRemoved, BlockStored

        for event in batch.events:
            if isinstance(event, BlockStored):
                tier = _tier(event.medium)
                keys = [_key(h) for h in event.block_hashes]
                self._held.setdefault(tier, set()).update(keys)
                self._events.append(BlocksStored(keys=keys, tier=tier))
            elif isinstance(event, BlockRemoved):
                tier = _tier(event.medium)
                keys = [_key(h) for h in event.block_hashes]
                self._held.get(tier, set()).difference_update(keys)
                self._events.append(BlocksRemoved(keys=keys, tier=tier))
            elif isinstance(event, VllmCleared):
                self._held.pop("device", None)  # the engine's own cache; the store keeps its blocks
                self._events.append(AllBlocksCleared())
        if self._events:
            self._changed.set()
        self._stored.set()
        self._stored = anyio.Event()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Receive until cancelled. Started (``task_status``) once connected, before the
        engine binds (ZMQ retries), so no event of the engine's is missed; a gap in vLLM's
        sequence is logged. zmq's own asyncio socket: it runs on the loop anyio runs on."""
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
        task_status.started()
        try:
            while True:
                _topic, seq_bytes, payload = await sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if self.last_seq >= 0 and seq != self.last_seq + 1:
                    log.warning("vLLM KV events %d..%d lost", self.last_seq + 1, seq - 1)
                self.last_seq = seq
                self.apply(decoder.decode(payload))
        finally:
            sock.close(linger=0)


def _tier(medium: str | None) -> Tier:
    return "device" if medium is None or medium.upper() == "GPU" else "cluster"


def _key(block_hash: bytes | int) -> int:
    if isinstance(block_hash, int):
        return block_hash & (2**64 - 1)
    return key_of_digest(block_hash)


@dataclass(slots=True)
class _Decoding:
    scope: anyio.CancelScope  # its task's: ``abort`` cancels it
    held_tokens: int
    position: int = 1  # the output position of its first token (token 0: the prefill's, or its own)
    # Each choice's next output position, while it has not finished.
    next_positions: dict[int, int] = field(default_factory=dict)

    def start(self, choices: int) -> None:
        self.next_positions = dict.fromkeys(range(choices), self.position)


@dataclass(slots=True)
class _Live:
    """What exists only while the engine is served (``VllmEngine.serving``)."""

    llm: Any  # vLLM's AsyncLLM
    tasks: TaskGroup  # the engine's own tasks: the KV-event bridge and one per decode


class _Prefilled(NamedTuple):
    token: int
    cached_tokens: int
    transfer_params: dict | None
    finish_reason: FinishReason | None
    logprobs: TokenLogprobs | None


class VllmEngine:
    """One vLLM engine, for a prefill or a decode (or colocated) worker."""

    def __init__(self, config: VllmEngineConfig, model: str, role: str, worker_id: str) -> None:
        self.config = config
        self.model = model  # the model directory (or name) vLLM loads
        self.role = role
        self.worker_id = worker_id
        self.counters = EngineCounters()
        self.boot_s = 0.0
        self._work_dir = Path(config.work_dir or tempfile.mkdtemp(prefix=f"switchyard-{worker_id}-"))
        self._kv_events = VllmKvEvents(f"ipc://{self._work_dir / 'kv-events.sock'}")
        self._live: _Live | None = None
        self._decoding: dict[str, _Decoding] = {}
        self._ended: list[tuple[str, _Decoding]] = []  # decodes ended, until ``step`` takes their outputs
        self._outputs: list[StepOutput] = []
        self._ready = anyio.Event()  # replaced by each wait in ``step``, set by ``_emit``
        self._n = 0

    # --- lifecycle ------------------------------------------------------------------

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[None]:
        """Boot the engine; it serves until the block ends, its tasks in one task group.
        One that dies raises out of here (``EngineError``, in an ``ExceptionGroup``),
        cancelling the block: the worker goes down with it. vLLM is shut down on the way out."""
        started = time.monotonic()
        self._prepare_environment()
        llm = None
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(self._bridge_kv_events, name=f"{self.worker_id} KV-event bridge")  # connected
                llm = self._boot()
                self._live = _Live(llm, tg)
                self.boot_s = time.monotonic() - started
                log.info("vLLM engine (%s, kv %s) ready in %.1f s", self.role, self.config.kv_transfer, self.boot_s)
                try:
                    yield
                finally:
                    self._live = None
                    tg.cancel_scope.cancel()  # the bridge, and every decode (each aborts in vLLM)
        finally:
            if llm is not None:
                llm.shutdown()

    def _prepare_environment(self) -> None:
        self._work_dir.mkdir(parents=True, exist_ok=True)
        for name, value in self.config.environment(self._work_dir).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self.config.parallel.check_devices(_accelerators())

    def _boot(self) -> Any:
        """vLLM's engine, booted (synchronously: it starts its core process and waits for it)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = self.config.engine_args(self.model, self.role, self._work_dir, self._kv_events.endpoint)
        args = AsyncEngineArgs(**engine_args, disable_log_stats=True)
        return AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self.counters)])

    async def _bridge_kv_events(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """The KV-event bridge; without it the scheduler's index of this worker goes stale,
        so its end is the worker's end."""
        try:
            await self._kv_events.run(task_status=task_status)
        except Exception as exc:
            raise EngineError(f"{self.worker_id}: the vLLM KV-event bridge failed: {exc!r}") from exc
        raise EngineError(f"{self.worker_id}: the vLLM KV-event bridge stopped")

    def _serving(self) -> _Live:
        if self._live is None:
            raise EngineError(f"{self.worker_id}: the vLLM engine is not serving")
        return self._live

    # --- KvCacheView (the prefix cache the scheduler hears of) ------------------------

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return self._kv_events.cached_blocks()

    def take_kv_events(self) -> list[KvEvent]:
        return self._kv_events.take_kv_events()

    async def wait_kv_changes(self) -> None:
        """Returns when the engine reported a cache change not yet taken."""
        await self._kv_events.wait_changes()

    # --- prefill --------------------------------------------------------------------

    async def prefill(self, tasks: list[PrefillTask]) -> list[PrefillResult]:
        started = time.monotonic()
        outputs = await self._prefill_all(tasks)
        elapsed = time.monotonic() - started
        batch_tokens = sum(
            len(task.spec.prompt_tokens) - out.cached_tokens for task, out in zip(tasks, outputs, strict=True)
        )
        return [
            PrefillResult(
                request_id=task.spec.request_id,
                first_token=out.token,
                cached_tokens=out.cached_tokens,
                handle=self._handle(task.spec, out.transfer_params),
                prefill_s=elapsed,
                batch_tokens=batch_tokens,
                finish_reason=out.finish_reason,
                logprobs=out.logprobs,
            )
            for task, out in zip(tasks, outputs, strict=True)
        ]

    async def _prefill_all(self, tasks: list[PrefillTask]) -> list[_Prefilled]:
        """Submitted together, so that vLLM batches them; any failure fails the batch."""
        outputs: dict[int, _Prefilled] = {}

        async def one(i: int, task: PrefillTask) -> None:
            outputs[i] = await self._prefill_one(task)

        try:
            async with anyio.create_task_group() as tg:
                for i, task in enumerate(tasks):
                    tg.start_soon(one, i, task)
        except ExceptionGroup as group:
            first = group.exceptions[0]
            raise EngineError(f"prefill of {len(tasks)} failed: {type(first).__name__}: {first}") from group
        return [outputs[i] for i in range(len(tasks))]

    async def _prefill_one(self, task: PrefillTask) -> _Prefilled:
        spec = task.spec
        extra = {"kv_transfer_params": {"do_remote_decode": True}} if self.config.kv_transfer == "nixl" else None
        # min(1, min_tokens): token 0 may not be EOS when the request wants more.
        params = self._sampling(spec, max_tokens=1, min_tokens=min(1, spec.sampling.min_tokens), extra_args=extra)
        final = None
        async for output in self._serving().llm.generate(
            self._prompt(spec, spec.prompt_tokens), params, self._request_id(spec)
        ):
            final = output
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            raise EngineError(f"vLLM returned no token for {spec.request_id}")
        completion = final.outputs[0]
        token = completion.token_ids[0]
        logprobs = None
        if spec.sampling.logprobs is not None and completion.logprobs:
            logprobs = token_logprobs(completion.logprobs[0], token, spec.sampling.logprobs)
        return _Prefilled(
            token,
            final.num_cached_tokens or 0,
            final.kv_transfer_params,
            first_token_finish(completion.finish_reason),
            logprobs,
        )

    async def wait_handoff(self, tasks: list[PrefillTask], results: list[PrefillResult]) -> None:
        """Returns once the KV these prefills computed is in the Mooncake Store, so a decode
        engine finds it. vLLM writes it after the request's output (asynchronously); its
        connector reports each block once written (KV events, ``cluster`` tier). Past
        ``handoff_timeout_s`` the handoff goes ahead and the decode side reports what it
        could not load."""
        if self.config.kv_transfer != "mooncake-store":
            return
        block = self.config.block_size
        waiting: list[int] = []
        for task, result in zip(tasks, results, strict=True):
            spec = task.spec
            hashes = vllm_block_hashes(
                spec.prompt_tokens, block, cache_salt_for(spec.tenant, spec.model), self.config.hash_seed
            )
            # Blocks served from a cache were stored when first computed; the new ones are due.
            waiting += [key_of_digest(h) for h in hashes[result.cached_tokens // block :]]
        if not waiting:
            return
        timeout = self.config.handoff_timeout_s
        if not await self._kv_events.wait_stored("cluster", waiting, timeout):
            missing = len(set(waiting) - set(self._kv_events.cached_blocks().get("cluster", [])))
            log.warning(
                "%d of %d blocks not in the Mooncake Store after %.1f s: handing over anyway",
                missing,
                len(waiting),
                timeout,
            )

    def _handle(self, spec: RequestSpec, params: dict | None):
        common: dict[str, Any] = {
            "worker_id": self.worker_id,
            "num_tokens": len(spec.prompt_tokens),
            "block_size": self.config.block_size,
        }
        if self.config.kv_transfer == "lmcache":
            return LmcacheKvHandle(**common)
        if self.config.kv_transfer == "nixl":
            return NixlKvHandle(**common, params=json.dumps(params or {}))
        return MooncakeStoreKvHandle(**common)  # "none" too: nothing to find, all recomputed

    # --- decode ---------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._decoding)

    @property
    def held_tokens(self) -> int:
        return sum(d.held_tokens for d in self._decoding.values())

    def add(self, task: DecodeTask) -> None:
        spec = task.spec
        rid = spec.request_id
        # A migrated request's prompt ends with the output the client has: vLLM continues it
        # greedily as it is; only the output positions start where the client left off.
        first = 0 if spec.sampling.decode_samples_first else 1  # token 0: the prefill's, or ours
        decoding = _Decoding(
            anyio.CancelScope(), spec.sampling.kv_tokens(len(spec.prompt_tokens)), position=spec.resume_from + first
        )
        decoding.start(spec.sampling.n)
        self._decoding[rid] = decoding
        self._serving().tasks.start_soon(self._decode_one, task, decoding, name=f"decode {rid}")

    def abort(self, request_id: str) -> bool:
        decoding = self._decoding.pop(request_id, None)
        if decoding is None:
            return False
        decoding.scope.cancel()  # its task tells vLLM (``_decode_one``)
        return True

    async def step(self) -> list[StepOutput]:
        while True:
            outputs, self._outputs = self._outputs, []
            ended, self._ended = self._ended, []
            for rid, decoding in ended:  # their last outputs are in ``outputs``: now they leave
                if self._decoding.get(rid) is decoding:
                    del self._decoding[rid]
            if outputs or not self._decoding:
                return outputs
            self._ready = anyio.Event()
            await self._ready.wait()

    def _emit(self, output: StepOutput) -> None:
        self._outputs.append(output)
        self._ready.set()

    async def _decode_one(self, task: DecodeTask, decoding: _Decoding) -> None:
        """One request's decode, in its own cancel scope. vLLM failing the request fails
        the request (an ``abort`` output, logged); vLLM's engine dead fails the worker."""
        rid = task.spec.request_id
        llm = self._serving().llm
        vllm_rid = self._request_id(task.spec)
        with decoding.scope:
            try:
                await self._stream_decode(llm, task, vllm_rid, decoding)
            except Exception as exc:
                refused = str(exc) if _refuses_request(exc) and not llm.errored else None
                for index, position in decoding.next_positions.items():  # every choice still going ends
                    self._emit(
                        StepOutput(
                            request_id=rid,
                            token=None,
                            position=position,
                            finished="abort",
                            index=index,
                            refused=refused,
                        )
                    )
                if llm.errored:
                    raise EngineError(f"{self.worker_id}: the vLLM engine died decoding {rid}") from exc
                if refused is not None:
                    log.warning("%s: vLLM refused the request: %s", rid, refused)
                else:
                    log.exception("%s: decode failed", rid)
            except anyio.get_cancelled_exc_class():
                # Aborted, or the engine is stopping. vLLM aborts a request whose generator
                # closes, but that await is cancelled too (anyio cancels until the scope
                # exits): tell it here, shielded.
                with anyio.move_on_after(5, shield=True):
                    await llm.abort(vllm_rid)
                raise
            finally:
                # It stays ``running`` until ``step`` took its last outputs: a request vLLM
                # refuses before any await ends here before the role's loop first looks at
                # ``running``, which would otherwise never step for its refusal. (One aborted
                # is out of ``_decoding`` already: nothing of it is left to take.)
                if self._decoding.get(rid) is decoding:
                    self._ended.append((rid, decoding))
                self._ready.set()

    async def _stream_decode(self, llm: Any, task: DecodeTask, vllm_rid: str, decoding: _Decoding) -> None:
        """vLLM's outputs for one request, as ``StepOutput``s from position 1 on."""
        from vllm.sampling_params import RequestOutputKind

        spec = task.spec
        rid = spec.request_id
        expected = 0 if self.config.kv_transfer == "none" else _expected_loaded(task, self.worker_id)
        extra = decode_transfer_args(task.handle)
        sampling = spec.sampling
        if sampling.decode_samples_first:  # every token here, the grammar whole
            prompt, max_tokens, min_tokens = spec.prompt_tokens, sampling.max_tokens, sampling.min_tokens
        else:  # after the prefill's token 0
            prompt, max_tokens = [*spec.prompt_tokens, task.first_token], sampling.max_tokens - 1
            min_tokens = max(0, sampling.min_tokens - 1)
        params = self._sampling(
            spec,
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            n=sampling.n,
            grammar=True,
            extra_args=extra,
            kind=RequestOutputKind.DELTA,
        )
        loaded = None
        async for output in llm.generate(self._prompt(spec, prompt), params, vllm_rid):
            if loaded is None:
                loaded = output.num_cached_tokens or 0
                if loaded < expected:
                    log.warning(
                        "%s: KV handed over for %d prompt tokens, engine loaded %d: recomputed", rid, expected, loaded
                    )
            for completion in output.outputs:  # one per choice that moved (n > 1: vLLM's children)
                self._emit_choice(rid, decoding, completion, output.finished, sampling.logprobs, expected, loaded)

    def _emit_choice(
        self,
        rid: str,
        decoding: _Decoding,
        completion: Any,
        all_done: bool,
        asked: int | None,
        expected: int,
        loaded: int,
    ) -> None:
        index = getattr(completion, "index", 0)
        position = decoding.next_positions.get(index)
        if position is None:
            return  # finished already
        tokens = list(completion.token_ids)
        done = completion.finish_reason is not None or (all_done and len(decoding.next_positions) == 1)
        reason = _FINISH.get(completion.finish_reason, "stop") if done else None
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            logprobs = None
            if asked is not None and completion.logprobs and i < len(completion.logprobs):
                logprobs = token_logprobs(completion.logprobs[i], token, asked)
            self._emit(
                StepOutput(
                    request_id=rid,
                    token=token,
                    position=position,
                    finished=reason if last else None,
                    kv_expected_tokens=expected if last and reason else 0,
                    kv_loaded_tokens=min(loaded, expected) if last and reason else 0,
                    logprobs=logprobs,
                    index=index,
                )
            )
            position += 1
        if done and not tokens:  # finished with nothing new: close the choice
            self._emit(
                StepOutput(
                    request_id=rid,
                    token=None,
                    position=position,
                    finished=reason or "stop",
                    kv_expected_tokens=expected,
                    kv_loaded_tokens=min(loaded, expected),
                    index=index,
                )
            )
        if done:
            del decoding.next_positions[index]
        else:
            decoding.next_positions[index] = position

    # --- shared ---------------------------------------------------------------------

    def _request_id(self, spec: RequestSpec) -> str:
        self._n += 1  # a retried request may come back to this engine: ids stay unique
        return f"{spec.request_id}.{self._n}"

    def _prompt(self, spec: RequestSpec, tokens: list[int]) -> dict[str, Any]:
        return {"prompt_token_ids": tokens, "cache_salt": cache_salt_for(spec.tenant, spec.model)}

    def _sampling(
        self,
        spec: RequestSpec,
        *,
        max_tokens: int,
        min_tokens: int,
        n: int = 1,
        grammar: bool = False,
        extra_args: dict | None = None,
        kind=None,
    ):
        """vLLM's sampling params for one run: the prefill's (one token, one choice, no grammar:
        it only computes the prompt once, and a constrained request's token 0 is the decode's)
        or the decode's (every choice, under the request's grammar when it has one). The grammar
        is not compiled on the prefill engine, so a schema vLLM refuses fails its own decode
        alone, never the prefill batch it shared with other requests."""
        from vllm import SamplingParams

        s = spec.sampling
        if self.config.kv_transfer == "lmcache":
            # LMCache keys its chunks by tokens alone: vLLM's cache_salt does not reach them.
            # A tag does, so one tenant's prompt never loads another tenant's KV.
            extra_args = dict(extra_args or {})
            params = dict(extra_args.get("kv_transfer_params") or {})
            params["lmcache.tag.salt"] = cache_salt_for(spec.tenant, spec.model)
            extra_args["kv_transfer_params"] = params
        kwargs: dict[str, Any] = {
            "max_tokens": max_tokens,
            "min_tokens": min_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k,
            "min_p": s.min_p,
            "presence_penalty": s.presence_penalty,
            "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty,
            "logit_bias": s.logit_bias,
            "ignore_eos": s.ignore_eos,
            "stop_token_ids": s.stop_token_ids or None,
            "logprobs": s.logprobs,
            "seed": s.seed,  # vLLM gives choice i of n the seed + i
            "n": n,
            "detokenize": False,
            "extra_args": extra_args,
        }
        if grammar and s.structured is not None:
            kwargs["structured_outputs"] = structured_params(s.structured)
        if kind is not None:
            kwargs["output_kind"] = kind
        return SamplingParams(**kwargs)


def structured_params(structured: StructuredOutput) -> Any:
    """Ours, as vLLM's structured-output backend reads it."""
    from vllm.sampling_params import StructuredOutputsParams

    return StructuredOutputsParams(
        json=structured.json_schema,
        json_object=structured.json_object or None,
        regex=structured.regex,
        choice=structured.choice,
        grammar=structured.grammar,
    )


def token_logprobs(position: dict[int, Any], token: int, k: int) -> TokenLogprobs:
    """vLLM's logprobs at one position (token id -> ``Logprob``: the sampled token's, and the
    ``k`` most likely by rank) as the bus carries them."""
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None)[:k]
    sampled = position.get(token)
    return TokenLogprobs(
        logprob=sampled.logprob if sampled is not None else float("-inf"),
        top_ids=[tid for _, tid, _ in top],
        top_logprobs=[logprob for _, _, logprob in top],
    )


def first_token_finish(reason: str | None) -> FinishReason | None:
    """What vLLM's reason for ending a prefill (run with ``max_tokens=1``) means for the
    request: "stop" is EOS or a stop token, which ends it there; "length" is only our
    cap of one token, and decode goes on."""
    return "stop" if reason == "stop" else None


def decode_transfer_args(handle: Any) -> dict[str, Any] | None:
    """What the decode engine's request carries for its connector: for NIXL, the prefill
    engine's transfer params (where its blocks are) and the order to pull them; the
    store-backed paths find blocks by hash and need nothing."""
    if isinstance(handle, NixlKvHandle):
        return {"kv_transfer_params": json.loads(handle.params) | {"do_remote_prefill": True}}
    return None


def _refuses_request(exc: Exception) -> bool:
    """vLLM's own verdict on the request, not a failure of the engine: its client errors
    (``VLLMValidationError``: a JSON schema no grammar backend compiles) and the
    ``ValueError``s its input processing raises, which vLLM's OpenAI server answers 400."""
    from vllm.exceptions import VLLMClientError

    return isinstance(exc, VLLMClientError | ValueError)


def _expected_loaded(task: DecodeTask, worker_id: str) -> int:
    """Prompt tokens whose KV the handle promises: its whole blocks. The engine computes
    at least the token after them, so a block-aligned prompt still loads them all when token
    0 follows it; when this engine samples token 0 itself (``decode_samples_first``), it
    computes the prompt's last token, and a block-aligned prompt's last block is not loaded."""
    handle = task.handle
    if not isinstance(handle, (MooncakeStoreKvHandle, LmcacheKvHandle, NixlKvHandle)):
        return 0
    if handle.worker_id == worker_id:
        return 0  # computed here (a local prefill): nothing was handed over
    loadable = handle.num_tokens - 1 if task.spec.sampling.decode_samples_first else handle.num_tokens
    return loadable // handle.block_size * handle.block_size


def _accelerators() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no usable CUDA runtime: a CPU host
        return 0
