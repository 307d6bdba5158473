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

Tokens stream out as vLLM yields them: each request's generator feeds one queue that
``step`` drains, so the decode role publishes whatever every sequence produced since
its last publish, in one bus message per ingress.

The engine's KV-cache events (stored, removed, cleared) arrive over ZMQ from the engine
core process; ``VllmKvEvents`` turns vLLM's block hashes into the bus's block keys
(``kvbus.keys.key_of_digest``) and keeps the set of blocks held, for snapshots.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from switchyard.kvbus.keys import cache_salt_for, key_of_digest, vllm_block_hashes
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
    Tier,
)
from switchyard.workers.engine import PrefillResult, StepOutput
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
        self.changed = asyncio.Event()
        self._stored = asyncio.Event()  # set on every batch: wakes ``wait_stored``
        self.last_seq = -1

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return {tier: list(keys) for tier, keys in self._held.items() if keys}

    def holds(self, tier: Tier, keys: list[int]) -> bool:
        return set(keys) <= self._held.get(tier, set())

    async def wait_stored(self, tier: Tier, keys: list[int], timeout_s: float) -> bool:
        """True once every key is reported stored in ``tier``; False after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self.holds(tier, keys):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._stored.clear()
            try:
                await asyncio.wait_for(self._stored.wait(), left)
            except TimeoutError:
                return self.holds(tier, keys)
        return True

    def take_kv_events(self) -> list[KvEvent]:
        events, self._events = self._events, []
        self.changed.clear()
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
            self.changed.set()
        self._stored.set()

    async def run(self) -> None:
        """Receive until cancelled. Connects before the engine binds (ZMQ retries), so no
        event of the engine's is missed; a gap in vLLM's sequence is logged."""
        import msgspec
        import zmq
        import zmq.asyncio
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(self.endpoint)
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
    task: asyncio.Task
    held_tokens: int


class VllmEngine:
    """One vLLM engine, for a prefill or a decode (or colocated) worker."""

    def __init__(self, config: VllmEngineConfig, model: str, role: str, worker_id: str) -> None:
        self.config = config
        self.model = model  # the model directory (or name) vLLM loads
        self.role = role
        self.worker_id = worker_id
        self.counters = EngineCounters()
        self.boot_s = 0.0
        self._engine: Any = None
        self._kv_events: VllmKvEvents | None = None
        self._bridge: asyncio.Task | None = None
        self._decoding: dict[str, _Decoding] = {}
        self._outputs: list[StepOutput] = []
        self._ready = asyncio.Event()
        self._n = 0

    # --- lifecycle ------------------------------------------------------------------

    async def start(self) -> None:
        """Boot the engine; returns when it can serve."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.monotonic()
        work_dir = Path(self.config.work_dir or tempfile.mkdtemp(prefix=f"switchyard-{self.worker_id}-"))
        work_dir.mkdir(parents=True, exist_ok=True)
        for name, value in self.config.environment(work_dir).items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
        self.config.parallel.check_devices(_accelerators())
        endpoint = f"ipc://{work_dir / 'kv-events.sock'}"
        self._kv_events = VllmKvEvents(endpoint)
        self._bridge = asyncio.create_task(self._kv_events.run())
        args = AsyncEngineArgs(
            **self.config.engine_args(self.model, self.role, work_dir, endpoint), disable_log_stats=True
        )
        self._engine = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(self.counters)])
        self.boot_s = time.monotonic() - started
        log.info("vLLM engine (%s, kv %s) ready in %.1f s", self.role, self.config.kv_transfer, self.boot_s)

    async def stop(self) -> None:
        for decoding in self._decoding.values():
            decoding.task.cancel()
        if self._bridge is not None:
            self._bridge.cancel()
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None

    # --- KvCacheView (the prefix cache the scheduler hears of) ------------------------

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return self._kv_events.cached_blocks() if self._kv_events else {}

    def take_kv_events(self) -> list[KvEvent]:
        return self._kv_events.take_kv_events() if self._kv_events else []

    async def wait_kv_changes(self) -> None:
        """Returns when the engine reported a cache change not yet taken."""
        assert self._kv_events is not None
        await self._kv_events.changed.wait()

    # --- prefill --------------------------------------------------------------------

    async def prefill(self, tasks: list[PrefillTask]) -> list[PrefillResult]:
        started = time.monotonic()
        outputs = await asyncio.gather(*(self._prefill_one(task) for task in tasks))
        elapsed = time.monotonic() - started
        batch_tokens = sum(len(task.spec.prompt_tokens) - cached for task, (_, cached, _) in zip(tasks, outputs))
        return [
            PrefillResult(
                request_id=task.spec.request_id,
                first_token=token,
                cached_tokens=cached,
                handle=self._handle(task.spec, params),
                prefill_s=elapsed,
                batch_tokens=batch_tokens,
            )
            for task, (token, cached, params) in zip(tasks, outputs)
        ]

    async def _prefill_one(self, task: PrefillTask) -> tuple[int, int, dict | None]:
        spec = task.spec
        extra = {"kv_transfer_params": {"do_remote_decode": True}} if self.config.kv_transfer == "nixl" else None
        params = self._sampling(spec, max_tokens=1, extra_args=extra)
        final = None
        async for output in self._engine.generate(
            self._prompt(spec, spec.prompt_tokens), params, self._request_id(spec)
        ):
            final = output
        if final is None or not final.outputs or not final.outputs[0].token_ids:
            raise RuntimeError(f"vLLM returned no token for {spec.request_id}")
        return final.outputs[0].token_ids[0], final.num_cached_tokens or 0, final.kv_transfer_params

    async def wait_handoff(self, tasks: list[PrefillTask], results: list[PrefillResult]) -> None:
        """Returns once the KV these prefills computed is in the Mooncake Store, so a decode
        engine finds it. vLLM writes it after the request's output (asynchronously); its
        connector reports each block once written (KV events, ``cluster`` tier). Past
        ``handoff_timeout_s`` the handoff goes ahead and the decode side reports what it
        could not load."""
        if self.config.kv_transfer != "mooncake-store" or self._kv_events is None:
            return
        block = self.config.block_size
        waiting: list[int] = []
        for task, result in zip(tasks, results):
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
        common = {
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
        rid = task.spec.request_id
        held = len(task.spec.prompt_tokens) + task.spec.sampling.max_tokens
        self._decoding[rid] = _Decoding(asyncio.create_task(self._decode_one(task)), held)

    def abort(self, request_id: str) -> bool:
        decoding = self._decoding.pop(request_id, None)
        if decoding is None:
            return False
        decoding.task.cancel()  # vLLM aborts a request whose generator is closed
        return True

    async def step(self) -> list[StepOutput]:
        while not self._outputs and self._decoding:
            self._ready.clear()
            await self._ready.wait()
        outputs, self._outputs = self._outputs, []
        return outputs

    def _emit(self, output: StepOutput) -> None:
        self._outputs.append(output)
        self._ready.set()

    async def _decode_one(self, task: DecodeTask) -> None:
        from vllm.sampling_params import RequestOutputKind

        spec = task.spec
        rid = spec.request_id
        expected = 0 if self.config.kv_transfer == "none" else _expected_loaded(task, self.worker_id)
        extra = decode_transfer_args(task.handle)
        params = self._sampling(
            spec, max_tokens=spec.sampling.max_tokens - 1, extra_args=extra, kind=RequestOutputKind.DELTA
        )
        position, loaded = 1, None
        try:
            async for output in self._engine.generate(
                self._prompt(spec, [*spec.prompt_tokens, task.first_token]), params, self._request_id(spec)
            ):
                if loaded is None:
                    loaded = output.num_cached_tokens or 0
                    if loaded < expected:
                        log.warning(
                            "%s: KV handed over for %d prompt tokens, engine loaded %d: recomputed",
                            rid,
                            expected,
                            loaded,
                        )
                completion = output.outputs[0]
                tokens = list(completion.token_ids)
                reason = _FINISH.get(completion.finish_reason, "stop") if output.finished else None
                for i, token in enumerate(tokens):
                    last = i == len(tokens) - 1
                    self._emit(
                        StepOutput(
                            request_id=rid,
                            token=token,
                            position=position,
                            finished=reason if last else None,
                            kv_expected_tokens=expected if last and reason else 0,
                            kv_loaded_tokens=min(loaded, expected) if last and reason else 0,
                        )
                    )
                    position += 1
                if output.finished and not tokens:  # finished with nothing new: close the stream
                    self._emit(
                        StepOutput(
                            request_id=rid,
                            token=None,
                            position=position,
                            finished=reason or "stop",
                            kv_expected_tokens=expected,
                            kv_loaded_tokens=min(loaded, expected),
                        )
                    )
        except Exception:
            log.exception("%s: decode failed", rid)
            self._emit(StepOutput(request_id=rid, token=None, position=position, finished="abort"))
        finally:
            if self._decoding.get(rid) is not None and self._decoding[rid].task is asyncio.current_task():
                del self._decoding[rid]
            self._ready.set()

    # --- shared ---------------------------------------------------------------------

    def _request_id(self, spec: RequestSpec) -> str:
        self._n += 1  # a retried request may come back to this engine: ids stay unique
        return f"{spec.request_id}.{self._n}"

    def _prompt(self, spec: RequestSpec, tokens: list[int]) -> dict[str, Any]:
        return {"prompt_token_ids": tokens, "cache_salt": cache_salt_for(spec.tenant, spec.model)}

    def _sampling(self, spec: RequestSpec, *, max_tokens: int, extra_args: dict | None = None, kind=None):
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
            "temperature": s.temperature,
            "top_p": s.top_p,
            "seed": s.seed,
            "detokenize": False,
            "extra_args": extra_args,
        }
        if kind is not None:
            kwargs["output_kind"] = kind
        return SamplingParams(**kwargs)


def decode_transfer_args(handle: Any) -> dict[str, Any] | None:
    """What the decode engine's request carries for its connector: for NIXL, the prefill
    engine's transfer params (where its blocks are) and the order to pull them; the
    store-backed paths find blocks by hash and need nothing."""
    if isinstance(handle, NixlKvHandle):
        return {"kv_transfer_params": json.loads(handle.params) | {"do_remote_prefill": True}}
    return None


def _expected_loaded(task: DecodeTask, worker_id: str) -> int:
    """Prompt tokens whose KV the handle promises: its whole blocks. The engine computes
    at least the token after them, so a block-aligned prompt still loads them all."""
    handle = task.handle
    if not isinstance(handle, (MooncakeStoreKvHandle, LmcacheKvHandle, NixlKvHandle)):
        return 0
    if handle.worker_id == worker_id:
        return 0  # computed here (a local prefill): nothing was handed over
    return handle.num_tokens // handle.block_size * handle.block_size


def _accelerators() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # no usable CUDA runtime: a CPU host
        return 0
