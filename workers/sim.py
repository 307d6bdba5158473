"""The ``sim`` engine: no tensors, times from a cost model, tokens from a hash.

Prefill time grows with the prompt tokens not found in a bounded LRU prefix cache
(keyed by the chained block keys the ingress computed); a decode step's time grows
with the batch. With every cost at zero it measures the fabric itself.

The cache has two tiers, as vLLM with a CPU offload connector has: blocks pushed out
of the device tier move down to an optional host tier (``host_cache_blocks``), from
which a hit costs ``host_fetch_per_token_s`` instead of a recompute. Both tiers report
their changes (``KvCacheView``), so the scheduler's index knows what is where.

The prefix cache reports itself (``workers.kv_events.KvCacheView``): what it stored
and evicted since last asked, netted per key so that the pending changes never
outgrow the cache (a block stored and evicted between two reports is never told).

Output tokens are a pure function of (sampling key, position): a greedy request
(temperature 0) or a seeded one gives the same text wherever and however often it
runs, which is what lets a prefill worker emit token 0 and a decode worker continue
at token 1 without ever producing a second first token. A migrated request
(``RequestSpec.resume_from``) keys on the client's prompt, not on the output it carries,
and counts positions from where the client left off: it continues the very same text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Annotated, Any

import anyio

from switchyard.schemas import (
    BlocksRemoved,
    BlocksStored,
    ConfigStruct,
    DecodeTask,
    FinishReason,
    KvEvent,
    PrefillTask,
    RequestSpec,
    SamplingParams,
    SimKvHandle,
    Tier,
    TokenLogprobs,
    setting,
)
from switchyard.workers.engine import PrefillResult, StepOutput
from switchyard.workers.errors import EngineError

log = logging.getLogger(__name__)
_MASK = (1 << 64) - 1


class SimCostModel(ConfigStruct, frozen=True, kw_only=True):
    """Seconds. Defaults are zero: the fabric's own overhead, nothing else."""

    prefill_base_s: Annotated[float, setting("sim: fixed seconds of one prefill", ge=0)] = 0.0
    prefill_per_token_s: Annotated[float, setting("sim: prefill seconds per uncached token", ge=0)] = 0.0
    decode_step_base_s: Annotated[float, setting("sim: fixed seconds of one decode step", ge=0)] = 0.0
    decode_step_per_seq_s: Annotated[float, setting("sim: decode step seconds per sequence in the batch", ge=0)] = 0.0
    host_fetch_per_token_s: Annotated[
        float, setting("sim: seconds per token to bring a host-tier block back to the device", ge=0)
    ] = 0.0

    def prefill_s(self, uncached_tokens: int) -> float:
        return self.prefill_base_s + self.prefill_per_token_s * uncached_tokens

    def decode_step_s(self, batch: int) -> float:
        return self.decode_step_base_s + self.decode_step_per_seq_s * batch


class SimEngineConfig(ConfigStruct, frozen=True, kw_only=True):
    cost: Annotated[SimCostModel, setting("the cost model", prefix="")] = SimCostModel()
    cache_blocks: Annotated[int, setting("sim: blocks the device prefix cache holds", gt=0)] = 4096
    host_cache_blocks: Annotated[int, setting("sim: a host-memory tier below the device cache (0: none)", ge=0)] = 0
    # Output tokens are drawn from [token_low, token_high): derived from the model's tokenizer.
    token_low: Annotated[int, setting("lowest output token", hidden=True)] = 256
    token_high: Annotated[int, setting("output tokens lie below this one", hidden=True)] = 4096
    eos_per_token: Annotated[
        float, setting("sim: the chance that an output token is EOS, ending the output early", ge=0, le=1)
    ] = 0.0
    eos_token_id: Annotated[int, setting("the model's EOS token (-1: none)", hidden=True)] = -1
    # The model's tokenizer.json: a structured request's output is its instance text, tokenized.
    tokenizer_path: Annotated[str, setting("the model's tokenizer.json", hidden=True)] = ""


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
        prompt = spec.prompt_tokens[: len(spec.prompt_tokens) - spec.resume_from]  # the client's own
        key = len(prompt)
        for token in prompt:
            key = _mix(key ^ token)
        return key
    digest = hashlib.blake2b(spec.request_id.encode(), digest_size=8).digest()
    return _mix(int.from_bytes(digest, "little"))


@dataclass
class SimCounters:
    """What the sim engine computed, as a vLLM engine counts it (``schemas.EngineStats``)."""

    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens it prefilled itself
    local_cache_hit_tokens: int = 0  # found in its prefix cache (either tier)

    def wire(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "computed_tokens": self.computed_tokens,
            "local_cache_hit_tokens": self.local_cache_hit_tokens,
        }


class SimEngine:
    """Plays both roles; a worker uses the half its role needs. It counts what it prefills
    (``counters``), so tests and /metrics see the same figures a vLLM engine gives."""

    def __init__(self, config: SimEngineConfig, worker_id: str) -> None:
        if not 0 <= config.token_low < config.token_high:
            raise ValueError(f"empty token range [{config.token_low}, {config.token_high})")
        self.config = config
        self.worker_id = worker_id
        self._device = TierCache("device", config.cache_blocks)
        self._host = TierCache("host", config.host_cache_blocks)  # capacity 0: holds nothing
        self._running: dict[str, list[_Sequence]] = {}  # each request's choices
        self._held = 0
        self._tokens: Any = None  # the tokenizer, loaded for the first structured request
        self.counters = SimCounters()

    def token(self, key: int, position: int) -> int:
        span = self.config.token_high - self.config.token_low
        return self.config.token_low + _mix(key ^ (position * 0x632BE59BD9B4E019 & _MASK)) % span

    def output(self, key: int, position: int, sampling: SamplingParams) -> tuple[int, FinishReason | None]:
        """The token at ``position`` and whether it ends the output, as an engine honours
        ``ignore_eos``, ``min_tokens`` and ``stop_token_ids``: EOS comes with chance
        ``eos_per_token`` (never with ``ignore_eos``), and neither EOS nor a stop token comes
        before ``min_tokens`` (the draw moves on, as a masked logit would)."""
        eos = self.config.eos_token_id
        allowed = position >= sampling.min_tokens
        chance = self.config.eos_per_token
        if chance and eos >= 0 and allowed and not sampling.ignore_eos:
            if _mix(key ^ 0xE05 ^ position) / 2**64 < chance:
                return eos, "stop"
        stops = sampling.stop_token_ids
        token, salt = self.token(key, position), 0
        while stops and token in stops and not allowed and salt < 64:
            salt += 1
            token = self.token(_mix(key ^ salt), position)
        return token, "stop" if stops and token in stops and allowed else None

    def logprobs(self, key: int, position: int, token: int, k: int) -> TokenLogprobs:
        """Made-up but consistent log-probabilities: the sampled token's in [-3, -1], the
        top ``k`` led by it and falling by 1 each (their probabilities sum below one)."""
        logprob = -1.0 - (_mix(key ^ 0x1096 ^ position) % 2000) / 1000
        span = self.config.token_high - self.config.token_low
        others = [self.config.token_low + (token - self.config.token_low + i) % span for i in range(1, k)]
        top = [token, *others][:k]
        return TokenLogprobs(logprob=logprob, top_ids=top, top_logprobs=[logprob - i for i in range(len(top))])

    # --- prefill ---------------------------------------------------------------------

    async def prefill(self, tasks: list[PrefillTask]) -> list[PrefillResult]:
        started = time.monotonic()
        hits = [self._hits(t) for t in tasks]  # (device tokens, host tokens) of each
        cached = [device + host for device, host in hits]
        uncached = sum(len(t.spec.prompt_tokens) - c for t, c in zip(tasks, cached, strict=True))
        fetched = sum(host for _, host in hits)
        cost = self.config.cost
        await anyio.sleep(cost.prefill_s(uncached) + cost.host_fetch_per_token_s * fetched)
        elapsed = time.monotonic() - started
        for task, hit in zip(tasks, cached, strict=True):
            self._remember(task.spec.block_keys)
            self.counters.prompt_tokens += len(task.spec.prompt_tokens)
            self.counters.computed_tokens += len(task.spec.prompt_tokens) - hit
            self.counters.local_cache_hit_tokens += hit
        return [self._result(t, c, elapsed, uncached) for t, c in zip(tasks, cached, strict=True)]

    def _result(self, task: PrefillTask, cached: int, elapsed: float, batch_tokens: int) -> PrefillResult:
        spec = task.spec
        handle = SimKvHandle(worker_id=self.worker_id, block_keys=spec.block_keys, num_tokens=len(spec.prompt_tokens))
        key, position, sampling = sampling_key(task), spec.resume_from, spec.sampling
        token, finished = self.output(key, position, sampling)
        logprobs = None if sampling.logprobs is None else self.logprobs(key, position, token, sampling.logprobs)
        return PrefillResult(
            request_id=spec.request_id,
            first_token=token,
            cached_tokens=cached,
            handle=handle,
            prefill_s=elapsed,
            batch_tokens=batch_tokens,
            finish_reason=finished,
            logprobs=logprobs,
        )

    def _hits(self, task: PrefillTask) -> tuple[int, int]:
        """Tokens of the prompt's leading blocks found on the device tier and on the host
        tier (a prefix is only as good as its first miss)."""
        device = host = 0
        for key in task.spec.block_keys:
            if key in self._device:
                self._device.touch(key)
                device += 1
            elif key in self._host:
                host += 1
            else:
                break
        return device * task.spec.block_size, host * task.spec.block_size

    def _remember(self, keys: list[int]) -> None:
        """The blocks are on the device now; what that pushes out moves down to the host."""
        for key in keys:
            self._host.discard(key)
            for evicted in self._device.add(key):
                self._host.add(evicted)

    # --- cache reporting (KvCacheView) ------------------------------------------------

    def cached_blocks(self) -> dict[Tier, list[int]]:
        blocks: dict[Tier, list[int]] = {"device": self._device.keys()}
        if self._host.capacity:
            blocks["host"] = self._host.keys()
        return blocks

    def take_kv_events(self) -> list[KvEvent]:
        return self._device.take_events() + self._host.take_events()

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
        sampling = spec.sampling
        self._remember(spec.block_keys)
        base = sampling_key(task)
        seqs = []
        for index in range(sampling.n):
            # Greedy choices are one choice n times, as on a real engine; sampled ones differ.
            greedy = sampling.temperature == 0.0 and sampling.seed is None
            key = base if index == 0 or greedy else _mix(base ^ (index * 0xC2B2AE3D27D4EB4F & _MASK))
            seqs.append(
                _Sequence(
                    key=key,
                    index=index,
                    # Token 0 came from the prefill, unless this engine samples it (a constrained
                    # output, or n choices).
                    next_position=spec.resume_from + (0 if sampling.decode_samples_first else 1),
                    max_tokens=spec.resume_from + sampling.max_tokens,
                    sampling=sampling,
                    script=self._structured(spec, key),
                    prompt_tokens=len(spec.prompt_tokens),
                )
            )
        self._running[spec.request_id] = seqs
        self._held += sampling.kv_tokens(len(spec.prompt_tokens))

    def _structured(self, spec: RequestSpec, key: int) -> list[int] | None:
        """A structured request's whole output: an instance of what it asked for, as a
        grammar-constrained engine would write one (``workers.sim_structured``), tokenized."""
        structured = spec.sampling.structured
        if structured is None:
            return None
        from switchyard.workers.sim_structured import instance_text

        try:
            if structured.choice:
                text = structured.choice[key % len(structured.choice)]
            elif structured.json_schema is not None or structured.json_object:
                schema = None if structured.json_schema is None else json.loads(structured.json_schema)
                text = instance_text(schema, key)
            else:
                raise ValueError("the sim engine writes JSON and choices only, not regexes or grammars")
        except ValueError as exc:  # UnsupportedSchema among them
            log.warning("%s: the sim engine cannot write this structured output: %s", spec.request_id, exc)
            return []  # ends at once, aborted: never an output that does not match
        return self._tokenizer().encode(text, add_special_tokens=False).ids

    def _tokenizer(self):
        if self._tokens is None:
            if not self.config.tokenizer_path:
                raise EngineError("the sim engine was given no tokenizer: it cannot write a structured output")
            from tokenizers import Tokenizer

            self._tokens = Tokenizer.from_file(self.config.tokenizer_path)
        return self._tokens

    def abort(self, request_id: str) -> bool:
        seqs = self._running.pop(request_id, None)
        if seqs:
            self._held -= seqs[0].sampling.kv_tokens(seqs[0].prompt_tokens)
        return seqs is not None

    async def step(self) -> list[StepOutput]:
        await anyio.sleep(self.config.cost.decode_step_s(sum(len(s) for s in self._running.values())))
        outputs = []
        for rid, seqs in list(self._running.items()):
            for seq in [s for s in seqs if not s.done]:
                position = seq.next_position
                seq.next_position += 1
                token, finished = self._next(seq, position)
                if finished is None and seq.next_position >= seq.max_tokens:
                    finished = "length"
                logprobs = None
                if seq.sampling.logprobs is not None:
                    logprobs = self.logprobs(seq.key, position, token, seq.sampling.logprobs)
                outputs.append(StepOutput(rid, token, position, finished, logprobs=logprobs, index=seq.index))
                seq.done = finished is not None
            if all(s.done for s in seqs):
                self.abort(rid)
        return outputs

    def _next(self, seq: _Sequence, position: int) -> tuple[int, FinishReason | None]:
        if seq.script is None:
            return self.output(seq.key, position, seq.sampling)
        if not seq.script:
            return self.config.token_low, "abort"
        index = position - (seq.max_tokens - seq.sampling.max_tokens)  # from the run's first token
        if index < len(seq.script):
            return seq.script[index], None
        eos = self.config.eos_token_id
        return (eos if eos >= 0 else seq.script[-1]), "stop"  # the grammar is complete: EOS


@dataclass(slots=True)
class _Sequence:
    """One choice of a request being decoded."""

    key: int
    index: int  # its choice
    next_position: int
    max_tokens: int  # the output position it ends before
    sampling: SamplingParams
    script: list[int] | None = None  # a structured output's tokens, from the run's first
    prompt_tokens: int = 0
    done: bool = False


class TierCache:
    """One tier's LRU of block keys, and its changes since they were last reported, net
    of each other (a key stored and evicted in between is never reported)."""

    def __init__(self, tier: Tier, capacity: int) -> None:
        self.tier, self.capacity = tier, capacity
        self._keys: OrderedDict[int, None] = OrderedDict()
        self._stored: dict[int, None] = {}  # absent at the last report, present now
        self._removed: dict[int, None] = {}  # present at the last report, absent now

    def __contains__(self, key: int) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        return list(self._keys)

    def touch(self, key: int) -> None:
        self._keys.move_to_end(key)

    def add(self, key: int) -> list[int]:
        """Store (or refresh) ``key``; returns the keys evicted to make room."""
        if self.capacity <= 0:
            return [key]
        if key in self._removed:
            del self._removed[key]  # back as it was at the last report
        elif key not in self._keys:
            self._stored[key] = None
        self._keys[key] = None
        self._keys.move_to_end(key)
        evicted = []
        while len(self._keys) > self.capacity:
            old, _ = self._keys.popitem(last=False)
            self._forget(old)
            evicted.append(old)
        return evicted

    def discard(self, key: int) -> None:
        if key in self._keys:
            del self._keys[key]
            self._forget(key)

    def _forget(self, key: int) -> None:
        if key in self._stored:
            del self._stored[key]  # never reported: nothing to take back
        else:
            self._removed[key] = None

    def take_events(self) -> list[KvEvent]:
        events: list[KvEvent] = []
        if self._stored:
            events.append(BlocksStored(keys=list(self._stored), tier=self.tier))
        if self._removed:
            events.append(BlocksRemoved(keys=list(self._removed), tier=self.tier))
        self._stored, self._removed = {}, {}
        return events
