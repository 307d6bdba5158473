"""Small factories for the pure-logic tier: wire messages with sensible defaults, a fake clock.

Every factory takes keyword overrides for what a test cares about and fills the rest, so
a test reads as the few facts it is about. Block keys are computed with the real
``kvbus.keys`` so that specs look exactly like the ones the ingress builds.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from switchyard.kvbus.keys import block_keys, salt_for
from switchyard.schemas import (
    LoadReport,
    PrefillDone,
    PrefillFailed,
    PromptUsage,
    RequestFinished,
    RequestSpec,
    Role,
    SamplingParams,
    SimKvHandle,
    WorkerLeaving,
)

MODEL = "switchyard-sim"
BLOCK_SIZE = 16
_ids = itertools.count(1)


@dataclass
class FakeClock:
    """Time that moves only when a test says so."""

    now: float = 1000.0

    def advance(self, seconds: float) -> float:
        assert seconds >= 0, "time does not run backwards"
        self.now += seconds
        return self.now


def prompt_of(length: int, start: int = 0) -> list[int]:
    """A deterministic prompt: ``length`` ordinary token ids (all below 4093)."""
    return [(start + 7 * i + 3) % 4000 for i in range(length)]


def make_spec(
    request_id: str | None = None,
    *,
    prompt_len: int = 32,
    prompt: list[int] | None = None,
    max_tokens: int = 8,
    ingress_id: str = "ingress-1",
    tenant: str = "default",
    session: str | None = None,
    priority: int = 0,
    deadline_s: float | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    block_size: int = BLOCK_SIZE,
    model: str = MODEL,
) -> RequestSpec:
    tokens = prompt if prompt is not None else prompt_of(prompt_len, start=next(_ids))
    return RequestSpec(
        request_id=request_id or f"req-{next(_ids)}",
        ingress_id=ingress_id,
        model=model,
        prompt_tokens=tokens,
        block_size=block_size,
        block_keys=list(block_keys(tokens, block_size, salt_for(tenant, model))),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed),
        tenant=tenant,
        session=session,
        priority=priority,
        deadline_s=deadline_s,
    )


def load_report(
    worker_id: str,
    role: Role = "prefill",
    *,
    budget: int = 1000,
    seq: int = 0,
    inflight: int = 0,
    running: int = 0,
    block_size: int = BLOCK_SIZE,
    interval_s: float = 0.5,
    device_class: str = "",
) -> LoadReport:
    return LoadReport(
        worker_id=worker_id,
        role=role,
        seq=seq,
        engine="sim",
        model=MODEL,
        block_size=block_size,
        token_budget=budget,
        inflight_tokens=inflight,
        running=running,
        interval_s=interval_s,
        device_class=device_class,
    )


def usage_of(spec: RequestSpec, *, cached: int = 0, prefill_s: float = 0.0) -> PromptUsage:
    return PromptUsage(prompt_tokens=len(spec.prompt_tokens), cached_tokens=cached, queued_s=0.0, prefill_s=prefill_s)


def prefill_done(
    spec: RequestSpec,
    worker_id: str,
    *,
    first_token: int = 300,
    finished: bool = False,
    cached: int = 0,
    prefill_s: float = 0.0,
) -> PrefillDone:
    handle = SimKvHandle(worker_id=worker_id, block_keys=spec.block_keys, num_tokens=len(spec.prompt_tokens))
    return PrefillDone(
        worker_id=worker_id,
        request_id=spec.request_id,
        handle=handle,
        first_token=first_token,
        usage=usage_of(spec, cached=cached, prefill_s=prefill_s),
        finished=finished,
    )


def prefill_failed(spec: RequestSpec, worker_id: str, message: str = "engine exploded") -> PrefillFailed:
    return PrefillFailed(worker_id=worker_id, request_id=spec.request_id, message=message)


def request_finished(
    spec: RequestSpec, worker_id: str, generated: int | None = None, step_s: float = 0.0
) -> RequestFinished:
    return RequestFinished(
        worker_id=worker_id,
        request_id=spec.request_id,
        generated_tokens=generated if generated is not None else spec.sampling.max_tokens,
        reason="length",
        step_s=step_s,
    )


def worker_leaving(worker_id: str) -> WorkerLeaving:
    return WorkerLeaving(worker_id=worker_id)
