"""Every message on the bus, as msgspec Structs.

Evolution rules (msgspec's): a new field gets a default and is appended; a field's
type never changes; decoders skip fields they do not know. Anything else is a new
``WIRE_VERSION`` in ``schemas.subjects``.

Unions are tagged (``"type"`` field) so that one typed decoder per subject can
``match`` on the variant. Expected outcomes (rejected, no capacity) are variants,
never exceptions.
"""

from __future__ import annotations

from typing import Literal, NewType

import msgspec

# A chained block key: key_i = H(key_{i-1}, tokens_i, salt). The ingress computes
# them (kvbus.keys) so that every component agrees on what a prefix is.
BlockKey = NewType("BlockKey", int)

Role = Literal["prefill", "decode", "both"]  # "both": a colocated worker, prefill and decode in one
Tier = Literal["device", "host", "disk", "cluster"]  # where a KV block lives, fastest first
FinishReason = Literal["length", "stop", "abort"]
RejectReason = Literal["overloaded", "no_workers", "too_large", "invalid"]


class _Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every bus message: immutable, keyword-only.

    Each subclass repeats ``frozen=True``: msgspec inherits it, but type checkers follow
    PEP 681 (``dataclass_transform``), which does not, and would call every message mutable.
    """


class StructuredOutput(_Wire, frozen=True):
    """What the output must match (one of them): the engine's grammar backend enforces it.

    Token 0 is sampled under the grammar too, so a request with one does not take its first
    token from the prefill engine: the decode engine samples every token, the grammar whole
    (see ``SamplingParams.decode_samples_first``)."""

    json_schema: str | None = None  # a JSON Schema, as JSON text
    json_object: bool = False  # any JSON object
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF / Lark, as the backend reads it


class SamplingParams(_Wire, frozen=True):
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: every token
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0  # no EOS or stop token before this many output tokens
    ignore_eos: bool = False
    stop_token_ids: list[int] = []  # each ends the output (after min_tokens); it is output itself
    logprobs: int | None = None  # None: none; k: the sampled token's and the k most likely
    structured: StructuredOutput | None = None
    # Choices: n sequences from one prompt, prefilled once and decoded side by side on one
    # decode worker, sharing the prompt's KV; their chunks carry ``StreamChunk.index``.
    n: int = 1

    @property
    def decode_samples_first(self) -> bool:
        """Token 0 is sampled where the rest is (decode), not by the prefill: a grammar's
        state cannot be handed from one engine to the other, and n choices need n tokens 0."""
        return self.structured is not None or self.n > 1

    def kv_tokens(self, prompt_tokens: int) -> int:
        """The KV tokens a request can come to hold decoding: the prompt once, each choice's output."""
        return prompt_tokens + self.n * self.max_tokens


class TokenLogprobs(_Wire, frozen=True, array_like=True):
    """One output token's log-probability, and the most likely tokens at its position."""

    logprob: float
    top_ids: list[int] = []
    top_logprobs: list[float] = []


class RequestSpec(_Wire, frozen=True):
    """One admitted generation request, as the ingress tokenized it."""

    request_id: str
    ingress_id: str
    model: str
    prompt_tokens: list[int]
    block_size: int
    block_keys: list[int]  # one per full block of prompt_tokens
    sampling: SamplingParams
    tenant: str = "default"
    session: str | None = None
    priority: int = 0  # 0 interactive; higher numbers wait behind lower ones
    deadline_s: float | None = None  # seconds after arrival by which the first token is due
    # A request migrated after its worker was lost: the last ``resume_from`` prompt tokens are
    # output the client already has, and this run's first token is output position resume_from.
    resume_from: int = 0
    # How many times the ingress submitted it again after losing its worker (a migration, or
    # a retry before its first token): already admitted once, so it is not refused for load,
    # and it goes to the head of the queue like any request that lost its worker.
    attempt: int = 0


# --- ingress -> scheduler (request/reply on SUBMIT) -------------------------------


class SubmitRequest(_Wire, frozen=True, tag="submit"):
    spec: RequestSpec


class StatusRequest(_Wire, frozen=True, tag="status"):
    pass


SchedulerRequest = SubmitRequest | StatusRequest


class Admitted(_Wire, frozen=True, tag="admitted"):
    request_id: str
    queue_position: int  # 0 when dispatched at once


class Rejected(_Wire, frozen=True, tag="rejected"):
    request_id: str
    reason: RejectReason
    message: str
    retry_after_s: float = 0.0


class EngineStats(_Wire, frozen=True):
    """What a worker's engine counted since it started (a vLLM engine's own counters)."""

    prompt_tokens: int = 0
    computed_tokens: int = 0  # prompt tokens it prefilled itself
    local_cache_hit_tokens: int = 0  # found in its own prefix cache
    external_hit_tokens: int = 0  # loaded through its KV connector
    kv_fallbacks: int = 0  # handed-over KV that did not arrive: recomputed
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class WorkerSummary(_Wire, frozen=True):
    worker_id: str
    role: Role
    inflight_tokens: int
    running: int
    engine: str = ""
    boot_s: float = 0.0
    stats: EngineStats | None = None
    token_budget: int = 0  # what the scheduler may place on it (0: not said, an older scheduler)


class ClusterStatus(_Wire, frozen=True, tag="cluster_status"):
    workers: list[WorkerSummary]
    queued_requests: int  # waiting for a prefill worker
    queued_tokens: int
    awaiting_decode: int = 0  # prefilled, waiting for decode room
    paused_requests: int = 0  # refused by a worker, waiting to be placed again
    # Requests the scheduler forgot because their worker no longer held them and the
    # message saying how they ended was lost (scheduler.audit): budget otherwise stranded.
    reclaimed_requests: int = 0
    session_bindings: int = 0  # held now
    sessions_dropped: int = 0  # since start: bindings to a worker that is gone
    # Since start: prefilled requests that ended before a decode worker took their KV. What
    # the prefill left is bounded by its transfer: the Mooncake Store's lease and eviction,
    # NIXL's KV lease on the prefill engine (--nixl-kv-lease-s), LMCache's own LRU.
    abandoned_handoffs: int = 0
    # Since start, by the scheduler's audits (scheduler.audit): runs a worker still held after
    # they had ended here, cancelled; and runs a worker named that this scheduler never placed
    # there, ignored (neither cancelled nor adopted).
    strays_cancelled: int = 0
    strays_ignored: int = 0


SchedulerReply = Admitted | Rejected | ClusterStatus


# --- KV handles: where a prefill left the KV blocks of a prompt --------------------


class SimKvHandle(_Wire, frozen=True, tag="sim"):
    """The sim engine's blocks: held in the prefill worker's (simulated) cache."""

    worker_id: str
    block_keys: list[int]
    num_tokens: int


class MooncakeStoreKvHandle(_Wire, frozen=True, tag="mooncake-store"):
    """A vLLM prefill saved the prompt's whole blocks to the Mooncake Store, keyed by the
    engine's block hashes: a decode engine with the same model and hash seed finds them."""

    worker_id: str
    num_tokens: int  # prompt tokens the prefill computed or found
    block_size: int


class LmcacheKvHandle(_Wire, frozen=True, tag="lmcache"):
    """A vLLM prefill stored the prompt's KV through LMCache (local memory and disk,
    Mooncake Store as remote tier): a decode engine's LMCache finds it by content."""

    worker_id: str
    num_tokens: int
    block_size: int


class NixlKvHandle(_Wire, frozen=True, tag="nixl"):
    """The KV stays in the prefill engine's GPU memory; the decode engine pulls it
    directly (NIXL). ``params`` is the engine's ``kv_transfer_params``, JSON-encoded."""

    worker_id: str
    num_tokens: int
    block_size: int
    params: str


KvHandle = SimKvHandle | MooncakeStoreKvHandle | LmcacheKvHandle | NixlKvHandle
VllmKvHandle = MooncakeStoreKvHandle | LmcacheKvHandle | NixlKvHandle


# --- scheduler -> worker (request/reply on worker_tasks(id)) ----------------------


class PromptUsage(_Wire, frozen=True):
    prompt_tokens: int
    cached_tokens: int
    queued_s: float = 0.0
    prefill_s: float = 0.0  # of the batch it was computed in
    batch_tokens: int = 0  # uncached tokens that batch computed in prefill_s (0: unknown); for the record: the scheduler measures rates over busy time


class PrefillTask(_Wire, frozen=True, tag="prefill"):
    spec: RequestSpec
    queued_s: float
    # What the scheduler's ledger charged the worker for it, reported back in ``HeldRequest``
    # so that a scheduler taking over counts what the one before counted (None: not said).
    charged_tokens: int | None = None


class DecodeTask(_Wire, frozen=True, tag="decode"):
    spec: RequestSpec
    handle: KvHandle
    first_token: int  # already streamed by the prefill worker (seq 0); -1 when decode samples it
    # (``SamplingParams.decode_samples_first``)
    usage: PromptUsage
    charged_tokens: int | None = None  # see PrefillTask


class LocalTask(_Wire, frozen=True, tag="local"):
    """Prefill and decode on one worker: a short uncached prompt is cheaper to compute
    where it will be decoded than to hand over (conditional disaggregation)."""

    spec: RequestSpec
    queued_s: float
    charged_tokens: int | None = None  # see PrefillTask


WorkerTask = PrefillTask | DecodeTask | LocalTask


class TaskAck(_Wire, frozen=True):
    request_id: str
    accepted: bool
    reason: str = ""


# --- workers -> scheduler (publish on WORKER_EVENTS) ------------------------------


class HeldRequest(_Wire, frozen=True):
    """One request a worker holds, as the scheduler that placed it charged it: what a
    scheduler taking over needs to rebuild its ledger without restarting anything."""

    request_id: str
    ingress_id: str
    phase: Literal["prefill", "decode"]
    tokens: int  # the scheduler's ledger for it (``charged_tokens`` of its task)
    decode_tokens: int  # prompt + max_tokens: its claim on decode capacity
    local: bool = False  # a LocalTask: prefilled where it decodes
    attempt: int = 0  # its RequestSpec.attempt


# Characters of ``LoadReport.device_class`` a worker may set and the scheduler keeps.
DEVICE_CLASS_MAX = 64


class LoadReport(_Wire, frozen=True, tag="load"):
    """Heartbeat. The first one registers the worker; silence past the expiry removes it."""

    worker_id: str
    role: Role
    seq: int
    engine: str
    model: str
    block_size: int
    token_budget: int  # in-flight tokens the worker accepts (prefill) / KV tokens it holds (decode)
    inflight_tokens: int
    running: int
    interval_s: float
    kv_seq: int = 0  # the last KvEventBatch it published: a lost last batch shows here
    kv_capacity_tokens: int = 0  # KV tokens it can hold decoding; 0: its token_budget (decode)
    boot_s: float = 0.0  # how long its engine took to start, before it first reported
    stats: EngineStats | None = None  # an engine that counts (vllm)
    # Every request it holds, in answer to a roll call (None in an ordinary heartbeat).
    held: list[HeldRequest] | None = None
    # The kind of hardware it runs on, as its operator names it (GPU model and parallelism):
    # the workers of a role that name one class share one prefill rate ("": one unnamed class).
    device_class: str = ""


class PrefillDone(_Wire, frozen=True, tag="prefill_done"):
    worker_id: str
    request_id: str
    handle: KvHandle
    first_token: int
    usage: PromptUsage
    finished: bool  # True when the first token already ended the request
    # The request itself, when the scheduler that placed it is gone: the one that took
    # over learned of it from a roll call (``HeldRequest``), without its prompt.
    spec: RequestSpec | None = None


class PrefillFailed(_Wire, frozen=True, tag="prefill_failed"):
    worker_id: str
    request_id: str
    message: str


class RequestFinished(_Wire, frozen=True, tag="finished"):
    worker_id: str
    request_id: str
    generated_tokens: int
    reason: FinishReason
    # Handed-over KV, checked against the engine's own counters on the decode worker:
    # whole-block prompt tokens the handle promised, and those the engine did not compute.
    # loaded < expected means the KV did not arrive and the engine recomputed it.
    kv_expected_tokens: int = 0
    kv_loaded_tokens: int = 0
    # The decode's steps: seconds from the first token this worker generated to the last,
    # over the steps between them (0 with fewer than two steps). What the decode worker's
    # load changes; the KV handoff before the first step is not in it.
    step_s: float = 0.0


class WorkerLeaving(_Wire, frozen=True, tag="leaving"):
    worker_id: str


WorkerEvent = LoadReport | PrefillDone | PrefillFailed | RequestFinished | WorkerLeaving


# --- KV cache events: workers -> scheduler (publish on KV_EVENTS) --------------------


class BlocksStored(_Wire, frozen=True, tag="stored"):
    keys: list[int]  # chained block keys, in prompt order
    tier: Tier = "device"


class BlocksRemoved(_Wire, frozen=True, tag="removed"):
    keys: list[int]
    tier: Tier = "device"


class AllBlocksCleared(_Wire, frozen=True, tag="cleared"):
    pass


KvEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class KvEventBatch(_Wire, frozen=True):
    """A worker's cache changes. ``seq`` counts batches per worker from 1; a receiver that
    sees a gap asks for a ``KvSnapshot`` instead of guessing."""

    worker_id: str
    seq: int
    events: list[KvEvent]


class KvSnapshotRequest(_Wire, frozen=True):
    scheduler_id: str


class KvSnapshot(_Wire, frozen=True):
    """Everything a worker's cache holds, as of batch ``seq`` (later batches apply on top)."""

    worker_id: str
    seq: int
    blocks: dict[str, list[int]]  # tier -> keys


class RollCall(_Wire, frozen=True):
    """The scheduler asks every worker to report now (it has just started)."""

    scheduler_id: str


# --- anyone -> everyone (publish on CANCEL) ---------------------------------------


class Cancel(_Wire, frozen=True):
    request_id: str
    reason: str = "client_disconnected"
    # Cancels the runs of ``RequestSpec.attempt`` up to this one; None: every run (the client
    # left). The ingress ends a stalled run this way before it submits the next attempt.
    attempt: int | None = None

    def covers(self, attempt: int) -> bool:
        return self.attempt is None or attempt <= self.attempt


# --- workers/scheduler -> ingress (publish on stream(ingress_id)) ------------------


class StreamError(_Wire, frozen=True):
    # "worker_lost", "prefill_failed", "overloaded", "deadline_exceeded", "internal";
    # "invalid_request": the engine refused the request itself (the client's error)
    code: str
    message: str
    retry_after_s: float | None = None  # "overloaded": when a retry may find room (HTTP Retry-After)


class StreamChunk(_Wire, frozen=True):
    """Tokens of one request. ``seq`` is the output position of ``token_ids[0]``, so a
    receiver drops what it has seen and waits for what it has not: a retried or
    migrated request never shows a duplicated or missing token."""

    request_id: str
    seq: int
    token_ids: list[int] = []
    finish_reason: FinishReason | None = None
    usage: PromptUsage | None = None  # on the prefill worker's chunk (seq 0)
    error: StreamError | None = None  # terminal
    # From the scheduler only: this worker now serves the request (prefill or decode), so
    # its chunks are accepted. Chunks of a worker never assigned are refused (subjects.stream).
    assigned: str | None = None
    # One per token of ``token_ids`` when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    index: int = 0  # the choice (``SamplingParams.n``); ``seq`` counts positions within it


class StreamBatch(_Wire, frozen=True):
    """One message per engine step per ingress, carrying every stream of that ingress."""

    sender: str
    chunks: list[StreamChunk]


# --- federation: region -> every region (subjects.fed_summary, fed_session) -------------


class RegionSummary(_Wire, frozen=True):
    """What a region's active scheduler says of its load, every ``summary_interval_s``: how
    the others decide whether to send it work (``scheduler.regions``). A region with no
    summary for ``dark_after_s`` is dark: dropped from routing."""

    region: str
    scheduler_id: str
    seq: int  # counts this scheduler's summaries from 1
    sent_at: float  # wall clock (informational: regions' clocks differ)
    predicted_wait_s: float  # to work off what is queued and in flight on its prefill fleet
    prefill_tokens_per_s: float  # its prefill fleet's rate (learned, or the configured default)
    queued_requests: int = 0
    queued_tokens: int = 0
    inflight_tokens: int = 0  # prompt tokens placed on its prefill workers
    prefill_budget_tokens: int = 0  # what its prefill workers accept at once
    decode_capacity_tokens: int = 0
    decode_demand_tokens: int = 0
    prefill_workers: int = 0
    decode_workers: int = 0
    # It would queue a new request past its spill threshold, or refuse it: send work elsewhere.
    saturated: bool = False
    spill_wait_s: float = 0.0  # its threshold: a router adds what it sent since (0: not said)


class SessionPlacement(_Wire, frozen=True):
    """The session directory's entry: the region that holds a session's prefix (subject
    ``fed_session(region of the writer, key)``; key: BLAKE2b-128 of tenant and session)."""

    region: str
    prompt_tokens: int  # the prompt that region last computed: its cached prefix, about
    at: float  # wall clock of the write: the newest entry of a key wins
    expires_at: float  # wall clock


__all__ = [
    "DEVICE_CLASS_MAX",
    "Admitted",
    "AllBlocksCleared",
    "BlockKey",
    "BlocksRemoved",
    "BlocksStored",
    "Cancel",
    "ClusterStatus",
    "DecodeTask",
    "EngineStats",
    "FinishReason",
    "HeldRequest",
    "KvEvent",
    "KvEventBatch",
    "KvHandle",
    "KvSnapshot",
    "KvSnapshotRequest",
    "LmcacheKvHandle",
    "LoadReport",
    "LocalTask",
    "MooncakeStoreKvHandle",
    "NixlKvHandle",
    "PrefillDone",
    "PrefillFailed",
    "PrefillTask",
    "PromptUsage",
    "RegionSummary",
    "RejectReason",
    "Rejected",
    "RequestFinished",
    "RequestSpec",
    "Role",
    "RollCall",
    "SamplingParams",
    "SchedulerReply",
    "SchedulerRequest",
    "SessionPlacement",
    "SimKvHandle",
    "StatusRequest",
    "StreamBatch",
    "StreamChunk",
    "StreamError",
    "StructuredOutput",
    "SubmitRequest",
    "TaskAck",
    "Tier",
    "TokenLogprobs",
    "VllmKvHandle",
    "WorkerEvent",
    "WorkerLeaving",
    "WorkerSummary",
    "WorkerTask",
]
