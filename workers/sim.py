"""The ``sim`` engine: no tensors, times from a cost model, tokens from a hash.

Prefill time grows with the prompt tokens not found in a bounded LRU prefix cache
(keyed by the chained block keys the ingress computed); a decode step's time grows
with the batch. With every cost at zero it measures the fabric itself.

The prefix cache reports itself (``workers.kv_events.KvCacheView``): what it stored
and evicted since last asked, netted per key so that the pending changes never
outgrow the cache (a block stored and evicted between two reports is never told).

Output tokens are a pure function of (sampling key, position): a greedy request
(temperature 0) or a seeded one gives the same text wherever and however often it
runs, which is what lets a prefill worker emit token 0 and a decode worker continue
at token 1 without ever producing a second first token.
"""

from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass

import anyio
import msgspec

from schemas import BlocksRemoved, BlocksStored, DecodeTask, KvEvent, PrefillTask, SimKvHandle, Tier
from workers.engine import PrefillResult, StepOutput

_MASK = (1 << 64) - 1


class SimCostModel(msgspec.Struct, frozen=True, kw_only=True):
    """Seconds. Defaults are zero: the fabric's own overhead, nothing else."""

    prefill_base_s: float = 0.0
    prefill_per_token_s: float = 0.0
    decode_step_base_s: float = 0.0
    decode_step_per_seq_s: float = 0.0

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * uncached_tokens

    def decode_step_s(self, batch: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * batch


class SimEngineConfig(msgspec.Struct, frozen=True, kw_only=True):
    cost: SimCostModel = SimCostModel()
    cache_blocks: int = 4096
    token_low: int = 256  # output tokens are drawn from [token_low, token_high)
    token_high: int = 4096


def _mix(x: int) -> int:
    """splitmix64's finaliser: a fast, well-spread integer hash."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def sampling_key(task: PrefillTask | DecodeTask) -> int:
    """Same key for the same greedy/seeded request; a fresh one per sampled request."""
    spec = task.spec
    if spec.sampling.seed is not None:
        return _mix(spec.sampling.seed)
    if spec.sampling.temperature == 0.0:
        key = len(spec.prompt_tokens)
        for token in spec.prompt_tokens:
            key = _mix(key ^ token)
        return key
    digest = hashlib.blake2b(spec.request_id.encode(), digest_size=8).digest()
    return _mix(int.from_bytes(digest, "little"))


class SimEngine:
    """Plays both roles; a worker uses the half its role needs."""

    def __init__(self, config: SimEngineConfig, worker_id: str) -> None:
        if not 0 <= config.token_low < config.token_high:
            raise ValueError(f"empty token range [{config.token_low}, {config.token_high})")
        self.config = config
        self.worker_id = worker_id
        self._cache: OrderedDict[int, None] = OrderedDict()
        # Changes since take_kv_events, net of each other: disjoint, each within the cache's size.
        self._stored: dict[int, None] = {}  # absent at the last report, present now
        self._removed: dict[int, None] = {}  # present at the last report, absent now
        self._running: dict[str, _Sequence] = {}
        self._held = 0

    def token(self, key: int, position: int) -> int:
        span = self.config.token_high - self.config.token_low
        return self.config.token_low + _mix(key ^ (position * 0x632BE59BD9B4E019 & _MASK)) % span

    # --- prefill ---------------------------------------------------------------------

    async def prefill(self, tasks: list[PrefillTask]) -> list[PrefillResult]:
        started = time.monotonic()
        cached = [self._cached_tokens(t) for t in tasks]
        uncached = sum(len(t.spec.prompt_tokens) - c for t, c in zip(tasks, cached))
        await anyio.sleep(self.config.cost.prefill_s(uncached))
        elapsed = time.monotonic() - started
        for task in tasks:
            self._remember(task.spec.block_keys)
        return [self._result(t, c, elapsed, uncached) for t, c in zip(tasks, cached)]

    def _result(self, task: PrefillTask, cached: int, elapsed: float, batch_tokens: int) -> PrefillResult:
        spec = task.spec
        handle = SimKvHandle(worker_id=self.worker_id, block_keys=spec.block_keys,
                             num_tokens=len(spec.prompt_tokens))
        return PrefillResult(request_id=spec.request_id, first_token=self.token(sampling_key(task), 0),
                             cached_tokens=cached, handle=handle, prefill_s=elapsed, batch_tokens=batch_tokens)

    def _cached_tokens(self, task: PrefillTask) -> int:
        hits = 0
        for key in task.spec.block_keys:
            if key not in self._cache:
                break
            self._cache.move_to_end(key)
            hits += 1
        return hits * task.spec.block_size

    def _remember(self, keys: list[int]) -> None:
        for key in keys:
            if key in self._removed:
                del self._removed[key]  # back as it was at the last report
            elif key not in self._cache:
                self._stored[key] = None
            self._cache[key] = None
            self._cache.move_to_end(key)
        while len(self._cache) > self.config.cache_blocks:
            key, _ = self._cache.popitem(last=False)
            if key in self._stored:
                del self._stored[key]  # never reported: nothing to take back
            else:
                self._removed[key] = None

    # --- cache reporting (KvCacheView) ------------------------------------------------

    def cached_blocks(self) -> dict[Tier, list[int]]:
        return {"device": list(self._cache)}

    def take_kv_events(self) -> list[KvEvent]:
        events: list[KvEvent] = []
        if self._stored:
            events.append(BlocksStored(keys=list(self._stored), tier="device"))
        if self._removed:
            events.append(BlocksRemoved(keys=list(self._removed), tier="device"))
        self._stored, self._removed = {}, {}
        return events

    # --- decode ----------------------------------------------------------------------

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def held_tokens(self) -> int:
        return self._held

    def add(self, task: DecodeTask) -> None:
        """Start decoding. The prompt's blocks were handed over (or computed here): they
        are in this worker's cache now, where the next turn of a conversation may hit."""
        spec = task.spec
        self._remember(spec.block_keys)
        seq = _Sequence(key=sampling_key(task), next_position=1, max_tokens=spec.sampling.max_tokens,
                        tokens=len(spec.prompt_tokens) + spec.sampling.max_tokens)
        self._running[spec.request_id] = seq
        self._held += seq.tokens

    def abort(self, request_id: str) -> bool:
        seq = self._running.pop(request_id, None)
        if seq is not None:
            self._held -= seq.tokens
        return seq is not None

    async def step(self) -> list[StepOutput]:
        await anyio.sleep(self.config.cost.decode_step_s(len(self._running)))
        outputs = []
        for rid, seq in list(self._running.items()):
            position = seq.next_position
            seq.next_position += 1
            done = seq.next_position >= seq.max_tokens
            outputs.append(StepOutput(rid, self.token(seq.key, position), position,
                                      "length" if done else None))
            if done:
                self.abort(rid)
        return outputs


@dataclass(slots=True)
class _Sequence:
    key: int
    next_position: int
    max_tokens: int
    tokens: int  # KV tokens it can come to hold
