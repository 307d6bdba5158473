"""The scheduler's bookkeeping: what each worker holds for us and where each request is.

The ledger (``WorkerState.assigned``) is the scheduler's own account of the tokens it
placed on a worker and has not yet seen released. Placement reads the ledger, not the
last heartbeat, so two requests arriving between heartbeats never both see an idle
worker. Heartbeats keep workers alive and carry their budgets. Each task tells its
worker what it was charged (``charged_tokens``), and a worker answers a roll call with
those figures (``HeldRequest``): a scheduler taking over rebuilds this very ledger.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from switchyard.schemas import LoadReport, PrefillDone, RequestSpec, Role

Phase = Literal["queued", "prefill", "awaiting_decode", "decode"]  # "prefill" covers a local task too


@dataclass
class WorkerState:
    worker_id: str
    role: Role
    token_budget: int
    block_size: int
    last_seen: float
    last_seq: int = -1
    assigned: dict[str, int] = field(default_factory=dict)  # request_id -> tokens
    load_tokens: int = 0
    prefill_rate: float = 8_000.0  # uncached tokens/s it computes, learned from its results
    # A colocated ("both") worker's second ledger: KV tokens of the sequences it decodes,
    # against its KV capacity, apart from the prefill tokens its budget bounds.
    kv_capacity: int = 0
    held: dict[str, int] = field(default_factory=dict)
    kv_tokens: int = 0
    last_report: LoadReport | None = None  # as reported: engine, boot time, engine counters

    def assign(self, request_id: str, tokens: int) -> None:
        assert request_id not in self.assigned, request_id
        self.assigned[request_id] = tokens
        self.load_tokens += tokens

    def hold(self, request_id: str, tokens: int) -> None:
        assert request_id not in self.held, request_id
        self.held[request_id] = tokens
        self.kv_tokens += tokens

    def release(self, request_id: str) -> None:
        self.load_tokens -= self.assigned.pop(request_id, 0)
        self.kv_tokens -= self.held.pop(request_id, 0)

    def kv_room(self, tokens: int) -> bool:
        return not self.held or self.kv_tokens + tokens <= self.kv_capacity

    def fits(self, tokens: int) -> bool:
        """Within budget, or idle: a prompt larger than any budget still runs, alone."""
        return self.load_tokens == 0 or self.load_tokens + tokens <= self.token_budget


@dataclass
class Tracked:
    spec: RequestSpec
    enqueued_at: float
    order: int  # arrival order, the FIFO tie-break within a priority
    phase: Phase = "queued"
    worker_id: str | None = None
    attempts: int = 0
    requeued: bool = False  # back in the queue after losing its worker: goes ahead
    virtual_start: float | None = None  # its place in the tenants' fair queue
    # When its prefill was dispatched, and the uncached tokens its worker then had to work
    # through up to and including its own: how the core learns each worker's rate.
    dispatched_at: float = 0.0
    ahead_tokens: int = 0
    late: bool = False  # predicted to miss the TTFT SLO: queued behind those that can meet it
    local: bool = False  # prefilled by the worker that decodes it (no handoff)
    prefill: PrefillDone | None = None  # set once prefill is done, for decode (re)placement
    decode_started: float | None = None  # when its decode was placed, to learn decode durations
    # Taken over from a scheduler that died: its spec has no prompt (see core's module note).
    adopted: bool = False

    @property
    def prompt_tokens(self) -> int:
        return len(self.spec.prompt_tokens)

    @property
    def decode_tokens(self) -> int:
        """KV tokens the request can come to hold on its decode worker."""
        return self.spec.sampling.kv_tokens(self.prompt_tokens)
