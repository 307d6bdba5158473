"""What a worker needs of an engine: ``sim`` (``workers.sim``) and ``vllm`` (``workers.vllm_engine``).

Prefill is a batch call (compute-bound: the engine batches what is queued); decode is
continuous batching: sequences join and leave between steps, and each ``step`` yields
one token for every running sequence.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from switchyard.schemas import DecodeTask, FinishReason, KvHandle, PrefillTask, TokenLogprobs


@dataclass(frozen=True, slots=True)
class PrefillResult:
    request_id: str
    first_token: int
    cached_tokens: int
    handle: KvHandle
    prefill_s: float  # the batch's time
    batch_tokens: int = 0  # uncached tokens the batch computed in that time
    # Set when token 0 itself ended the request (EOS or a stop token: "stop"): no decode follows.
    finish_reason: FinishReason | None = None
    logprobs: TokenLogprobs | None = None  # token 0's, when the request asked for them


@dataclass(frozen=True, slots=True)
class StepOutput:
    request_id: str
    token: int | None  # None: the sequence ended with no new token
    position: int  # output position of ``token``; the prefill's first token is 0
    finished: FinishReason | None
    # On a finishing output of a handed-over request: the whole-block prompt tokens the
    # handle promised, and those the engine loaded rather than computed.
    kv_expected_tokens: int = 0
    kv_loaded_tokens: int = 0
    logprobs: TokenLogprobs | None = None  # ``token``'s, when the request asked for them
    index: int = 0  # the choice it belongs to (``SamplingParams.n``)
    # On an ``abort``: the engine refused the request itself (a JSON schema its grammar
    # backend cannot compile, a parameter it does not take), with its reason. The client's
    # error (400), not the worker's.
    refused: str | None = None


class PrefillEngine(Protocol):
    """An engine that keeps a prefix cache also implements ``workers.kv_events.KvCacheView``,
    so that the scheduler's prefix index hears what it holds."""

    async def prefill(self, tasks: list[PrefillTask]) -> list[PrefillResult]: ...


@runtime_checkable
class HandoffEngine(Protocol):
    """A prefill engine whose KV reaches its store after the first token (vLLM's
    connectors write asynchronously): the role waits on it before announcing the handle."""

    async def wait_handoff(self, tasks: list[PrefillTask], results: list[PrefillResult]) -> None: ...


@runtime_checkable
class EngineLifecycle(Protocol):
    """An engine that boots and runs tasks of its own (``vllm``). The worker runs inside
    ``serving()``: entering boots the engine (a worker is announced only once its engine
    can serve); inside, the engine's tasks run in its task group, and one that dies raises
    out of the block, taking the worker down; leaving stops the engine."""

    boot_s: float

    def serving(self) -> AbstractAsyncContextManager[None]: ...


class Counters(Protocol):
    def wire(self) -> dict[str, int]:
        """The fields of ``schemas.EngineStats`` it counted (``kv_fallbacks`` is the role's)."""
        ...


@runtime_checkable
class CountingEngine(Protocol):
    """An engine that keeps its own statistics (``vllm``): the worker's heartbeat carries
    them to the scheduler (``LoadReport.stats``)."""

    @property
    def counters(self) -> Counters: ...


class DecodeEngine(PrefillEngine, Protocol):
    """Decodes; and prefills too, for a ``LocalTask`` (a short prompt decoded where it is
    computed, with no handoff)."""

    @property
    def running(self) -> int: ...

    @property
    def held_tokens(self) -> int: ...

    def add(self, task: DecodeTask) -> None: ...

    def abort(self, request_id: str) -> bool: ...

    async def step(self) -> list[StepOutput]: ...
