"""The scheduler's bookkeeping: what each worker holds for us and where each request is.

The ledger (``WorkerState.assigned``) is the scheduler's own account of the tokens it
placed on a worker and has not yet seen released. Placement reads the ledger, not the
last heartbeat, so two requests arriving between heartbeats never both see an idle
worker. Heartbeats keep workers alive and carry their budgets. Each task tells its
worker what it was charged (``charged_tokens``), and a worker answers a roll call with
those figures (``HeldRequest``): a scheduler taking over rebuilds this very ledger.

``Fleet`` holds the workers, and mirrors what placement scores them by into numpy arrays
by slot, so a policy may score the whole fleet in one vector expression instead of a
Python loop over 1,000 workers (``docs/bench-scheduler.md``). A ``WorkerState`` in a fleet
writes each mirrored field through to its slot as it is set (``__setattr__``; the ledger's
own methods write theirs directly, the same writes without the call): whoever sets
``load_tokens`` or ``prefill_rate``, the arrays cannot go stale. The one array written
late is ``rate``: a learnt sample changes every rate of its role, and they are rewritten
when next read (``Fleet.rate``), while the C placement multiplies them out as it scans.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from switchyard.scheduler.index import by_slot
from switchyard.scheduler.native import native as _native
from switchyard.schemas import LoadReport, PrefillDone, RequestSpec, Role, SharedBlocks

# "prefill" covers a local task too; "paused": its dispatch was refused, it goes back soon
Phase = Literal["queued", "prefill", "awaiting_decode", "decode", "paused"]


class LedgerBlocks(SharedBlocks):
    """``SharedBlocks`` for the core's ledger, whose loops over a prompt's keys run in C
    (``_native.share_add``, ``share_remove``: the same counts) where it was built: the core
    adds and removes every decode's keys, a worker only its own few."""

    __slots__ = ()
    native = _native is not None  # False: the Python loops (tests compare)

    def add(self, request_id: str, keys: Sequence[int], fresh: list[int] | None = None) -> int:
        if not self.native:
            return super().add(request_id, keys, fresh)
        assert request_id not in self._keys, request_id
        shared = _native.share_add(self._refs, keys, fresh) * self.block_size
        self._keys[request_id] = keys
        self.saved += shared
        return shared

    def remove(self, request_id: str, gone: list[int] | None = None) -> int:
        if not self.native:
            return super().remove(request_id, gone)
        keys = self._keys.pop(request_id, None)
        if keys is None:
            return 0
        dropped = _native.share_remove(self._refs, keys, gone) * self.block_size
        self.saved -= dropped
        return dropped


@dataclass
class WorkerState:
    worker_id: str
    role: Role
    token_budget: int
    block_size: int
    last_seen: float
    last_seq: int = -1
    assigned: dict[str, int] = field(default_factory=dict)  # request_id -> tokens
    # A decode ledger counts a prompt block that several of its decodes hold once, as the
    # engine does (``assign_decode``, ``hold_decode``): a decode worker's load_tokens =
    # sum(assigned) - shared.saved, a colocated worker's kv_tokens = sum(held) - shared.saved.
    shared: SharedBlocks | None = None
    load_tokens: int = 0
    # Uncached tokens/s it computes is ``prefill_rate``: out of a fleet this field; in one,
    # its role's shared rate times its own factor (``Fleet.learn_rate``), kept here when it leaves.
    own_rate: float = 8_000.0
    # How its rate is measured (``SchedulerCore._learn_rate``): ``prefill_mark`` is when its
    # current stretch of prefill began, its last prefill done or the dispatch that found its
    # ledger empty; the uncached tokens it computed and the seconds it was busy, both decayed.
    prefill_mark: float = 0.0
    rate_tokens: float = 0.0
    rate_busy_s: float = 0.0
    # A colocated ("both") worker's second ledger: KV tokens of the sequences it decodes,
    # against its KV capacity, apart from the prefill tokens its budget bounds.
    kv_capacity: int = 0
    held: dict[str, int] = field(default_factory=dict)
    kv_tokens: int = 0
    # A colocated worker's decodes' room for prefill beside them: ``placed_tokens`` counts the
    # prompt tokens ever placed on it, and each held decode keeps its SLO until that count
    # passes the edge it was held with (``hold``); ``room_edge`` is the least such edge.
    placed_tokens: float = 0.0
    room_edges: dict[str, float] = field(default_factory=dict)
    room_edge: float = math.inf
    # When a prompt last computed new blocks here, in the fleet's count of such placements
    # (``Fleet.fills``; 0: never): ``switchyard`` spreads new content by it.
    filled_at: float = 0.0
    # The kind of hardware it reported (``LoadReport.device_class``): the workers of a role
    # that report one class share one prefill rate (``Fleet.learn_rate``).
    device_class: str = ""
    last_report: LoadReport | None = None  # as reported: engine, boot time, engine counters
    fleet: Fleet | None = field(default=None, repr=False, compare=False)  # set by ``Fleet.add``
    slot: int = field(default=-1, repr=False, compare=False)  # its row in the fleet's arrays

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _MIRRORED:
            fleet = self.__dict__.get("fleet")
            if fleet is not None:
                fleet.mirror(self, name, value)
        object.__setattr__(self, name, value)

    @property
    def prefill_rate(self) -> float:
        fleet = self.__dict__.get("fleet")
        return self.own_rate if fleet is None else fleet.rate_of(self)

    @prefill_rate.setter
    def prefill_rate(self, value: float) -> None:
        fleet = self.__dict__.get("fleet")
        if fleet is None:
            self.own_rate = value
        else:
            fleet.set_rate(self, value)

    # The ledger's hot paths (``assign``, ``hold``, ``release``, ``touch``) write the mirrored
    # fields and their slots themselves, as ``Fleet.mirror`` would: no ``__setattr__`` call.

    def assign(self, request_id: str, tokens: int) -> None:
        d = self.__dict__
        assigned = d["assigned"]
        assert request_id not in assigned, request_id
        assigned[request_id] = tokens
        load = d["load_tokens"] = d["load_tokens"] + tokens
        fleet = d["fleet"]
        if fleet is not None:
            slot = d["slot"]
            fleet.load[slot] = load
            fleet.running[slot] = len(assigned)

    def assign_decode(self, request_id: str, tokens: int, keys: Sequence[int]) -> None:
        """Decode ``request_id`` here: ``tokens`` of KV on the ledger, less the prompt
        blocks (``keys``) a request decoding here already holds."""
        self.assign(request_id, tokens)
        self._share(request_id, keys)

    def hold_decode(self, request_id: str, tokens: int, room: float, keys: Sequence[int]) -> None:
        """``hold``, less the prompt blocks (``keys``) a decode held here already holds."""
        self.hold(request_id, tokens, room)
        self._share(request_id, keys)

    def _share(self, request_id: str, keys: Sequence[int]) -> None:
        shared = self.shared
        if shared is None:
            shared = self.shared = LedgerBlocks(self.block_size)
        fresh: list[int] = []
        saved = shared.add(request_id, keys, fresh)
        if saved:
            self._shift_saved(saved)
        fleet = self.__dict__["fleet"]
        if fresh and fleet is not None:
            fleet.hold_keys(self.slot, fresh, True)

    def sharing(self, keys: Sequence[int]) -> int:
        """Tokens of a prompt with these block keys that decodes here already hold."""
        shared = self.shared
        return shared.sharing(keys) if shared is not None else 0

    def _shift_saved(self, tokens: int) -> None:
        """``tokens`` more of its decodes' KV are shared blocks counted twice: that much less
        on its decode ledger (a decode worker's ``load_tokens``, a colocated one's ``kv_tokens``)."""
        d = self.__dict__
        fleet = d["fleet"]
        if d["role"] == "both":
            kv = d["kv_tokens"] = d["kv_tokens"] - tokens
            if fleet is not None:
                fleet.kv[d["slot"]] = kv
        else:
            load = d["load_tokens"] = d["load_tokens"] - tokens
            if fleet is not None:
                fleet.load[d["slot"]] = load
        if fleet is not None:
            fleet.decode_saved += tokens

    def hold(self, request_id: str, tokens: int, room: float = math.inf) -> None:
        """Decode ``request_id``'s ``tokens`` of KV here; it keeps its TPOT SLO through
        ``room`` more prompt tokens placed here."""
        held, d = self.held, self.__dict__
        assert request_id not in held, request_id
        held[request_id] = tokens
        kv = d["kv_tokens"] = d["kv_tokens"] + tokens
        fleet = d["fleet"]
        if fleet is not None:
            slot = d["slot"]
            fleet.kv[slot], fleet.holding[slot] = kv, len(held)
        if room < math.inf:
            edge = self.room_edges[request_id] = self.placed_tokens + room
            if edge < self.room_edge:
                self.room_edge = edge

    def release(self, request_id: str) -> None:
        d = self.__dict__
        assigned = d["assigned"]
        tokens = assigned.pop(request_id, None)
        if tokens is not None:
            load = d["load_tokens"] = d["load_tokens"] - tokens
            fleet = d["fleet"]
            if fleet is not None:
                slot = d["slot"]
                fleet.load[slot] = load
                fleet.running[slot] = len(assigned)
        held = d["held"]
        if held:  # only a colocated worker holds decodes
            tokens = held.pop(request_id, None)
            if tokens is not None:
                kv = d["kv_tokens"] = d["kv_tokens"] - tokens
                fleet = d["fleet"]
                if fleet is not None:
                    slot = d["slot"]
                    fleet.kv[slot] = kv
                    fleet.holding[slot] = len(held)
        shared = d["shared"]
        if shared is not None and request_id in shared:
            gone: list[int] = []
            self._shift_saved(-shared.remove(request_id, gone))  # its blocks others hold count once more
            fleet = d["fleet"]
            if gone and fleet is not None:
                fleet.hold_keys(d["slot"], gone, False)
        edges = d["room_edges"]
        if edges:
            edge = edges.pop(request_id, math.inf)
            if edge < math.inf and edge == self.room_edge:  # the least edge left; none set: nothing to mirror
                self.room_edge = min(edges.values(), default=math.inf)

    def touch(self, now: float) -> None:
        """Heard from at ``now``."""
        d = self.__dict__
        d["last_seen"] = now
        fleet = d["fleet"]
        if fleet is not None:
            fleet.last_seen[d["slot"]] = now

    @property
    def room_tokens(self) -> float:
        """Prompt tokens that can be placed here before a decode it holds misses its SLO."""
        return self.room_edge - self.placed_tokens

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
    # The worker of each dispatch of it that was refused, in order (a worker may repeat): how
    # long it pauses (``SchedulerCore.on_dispatch_failed``), and where it goes next (``_not_refused``).
    refused_by: tuple[str, ...] = ()
    refused_since: float | None = None  # its first refusal in this stage (prefill, then decode)
    requeued: bool = False  # back in the queue after losing its worker: goes ahead
    virtual_start: float | None = None  # its place in the tenants' fair queue
    dispatched_at: float | None = None  # when this scheduler dispatched its prefill (None: adopted)
    late: bool = False  # predicted to miss the TTFT SLO: queued behind those that can meet it
    local: bool = False  # prefilled by the worker that decodes it (no handoff)
    prefill: PrefillDone | None = None  # set once prefill is done, for decode (re)placement
    decode_started: float | None = None  # when its decode was placed, to learn decode durations
    # Taken over from a scheduler that died: its spec has no prompt (see core's module note).
    adopted: bool = False
    # Of ``spec``, read several times a request: computed once a spec, here and in ``respec``
    # (the only way to give a tracked request a new spec). ``prompt_tokens``: its prompt's
    # length; ``decode_tokens``: the KV tokens it can come to hold on its decode worker.
    prompt_tokens: int = field(default=0, init=False, repr=False, compare=False)
    decode_tokens: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.respec(self.spec)

    def respec(self, spec: RequestSpec) -> None:
        self.spec = spec
        self.prompt_tokens = tokens = len(spec.prompt_tokens)
        self.decode_tokens = spec.sampling.kv_tokens(tokens)


# What ``Fleet`` mirrors: the fields placement scores workers by. ``load_tokens`` also
# stands for ``len(assigned)`` and ``kv_tokens`` for ``len(held)``: every change to
# ``assigned`` or ``held`` (``assign``, ``hold``, ``release``) is followed by setting those,
# even to the same value.
_MIRRORED = frozenset(
    {
        "load_tokens",
        "kv_tokens",
        "token_budget",
        "kv_capacity",
        "last_seen",
        "role",
        "placed_tokens",
        "room_edge",
        "filled_at",
    }
)
# The arrays, and what a free slot reads.
_ARRAYS = {
    "load": 0.0,  # load_tokens (float64: exact for any ledger, < 2**53 tokens)
    "running": 0.0,  # len(assigned)
    "kv": 0.0,  # kv_tokens
    "holding": 0.0,  # len(held)
    "rate": 1.0,  # prefill_rate: its role's shared rate times its factor ("factor" over their mean)
    "factor": 1.0,  # raw: over the mean of its role's, how much faster it is than their shared rate
    "budget": 0.0,  # token_budget
    "kv_cap": 0.0,  # kv_capacity
    "colocated": 0.0,  # 1.0 for role "both"
    "last_seen": math.inf,
    "placed": 0.0,  # placed_tokens
    "room_edge": math.inf,
    "filled": 0.0,  # filled_at
}


def shareable_keys(spec: RequestSpec, worker: WorkerState) -> Sequence[int]:
    """The block keys of ``spec`` its decode on ``worker`` can share with others there: all
    of them, unless the worker's blocks are of another size (its engine's keys differ)."""
    return spec.block_keys if spec.block_size == worker.block_size else ()


def kv_share(worker: WorkerState) -> int:
    """What a worker adds to the decode fleet's KV capacity: a decode worker its budget,
    a colocated one its KV capacity, a prefill worker nothing. A colocated worker beside
    decode workers hands its decodes over as a prefill worker does: its KV counts only if
    the core may lend it (``Fleet.lends``), else admission would count on room no decode is
    ever sent to (a peer on such a fleet admitted 2,000 requests more than on prefill
    workers, on tool agents at 20 req/s, and served 12.2 req/s instead of 19.6)."""
    if worker.role == "decode":
        return worker.token_budget
    if worker.role != "both":
        return 0
    fleet = worker.fleet
    if fleet is not None and fleet.decode and not fleet.lends:
        return 0
    return worker.kv_capacity


class Fleet:
    """The workers by id (``workers``, in the order they joined, as are ``prefill``, the
    prefill-capable ones, and ``decode``), counters the core would otherwise recompute per
    request (``roles``, ``decode_capacity``), and arrays by slot of the mirrored fields
    (``_ARRAYS``). A free slot is in no role's slot list; a new worker takes the lowest."""

    load: npt.NDArray[np.float64]
    running: npt.NDArray[np.float64]
    kv: npt.NDArray[np.float64]
    holding: npt.NDArray[np.float64]
    _rate: npt.NDArray[np.float64]  # ``rate``, which may lag ``factor`` (see ``learn_rate``)
    factor: npt.NDArray[np.float64]
    budget: npt.NDArray[np.float64]
    kv_cap: npt.NDArray[np.float64]
    colocated: npt.NDArray[np.float64]
    last_seen: npt.NDArray[np.float64]
    placed: npt.NDArray[np.float64]
    room_edge: npt.NDArray[np.float64]
    filled: npt.NDArray[np.float64]

    def __init__(self) -> None:
        self.workers: dict[str, WorkerState] = {}
        self.prefill: dict[str, WorkerState] = {}  # role prefill or both
        self.decode: dict[str, WorkerState] = {}  # role decode
        # Colocated workers lent to decoding (``lend``): out of ``prefill``, so no prompt is
        # placed on them; decodes handed over from the others go to them.
        self.lent: dict[str, WorkerState] = {}
        # Whether the core may lend (``SchedulerCore``: the ``switchyard`` policy with a TPOT
        # SLO): then a colocated worker's KV is decode capacity even beside decode workers.
        self.lends = False
        # Every role present from the start, at 0: a read is a dict hit, not ``__missing__``.
        self.roles: Counter[str] = Counter({"prefill": 0, "decode": 0, "both": 0})
        # Prefill rates (``learn_rate``): per role, the rate its workers share, and the sum of
        # their raw factors (``factor``): a worker's rate is its raw factor over the mean.
        self.shared_rate: dict[str, float] = {}
        self._factor_sum: dict[str, float] = {}
        self.decode_capacity = 0
        # Of the decode ledgers' sum of each decode's KV, the shared blocks counted twice
        # (``WorkerState.shared``): what decoding requests claim is that sum less this.
        self.decode_saved = 0
        # Block key -> the slots whose decodes hold it (``decode_sharing``): ``_held_by`` the
        # slot where one alone does (most blocks: a conversation's own), ``_holding`` a bitset
        # of the slots once two or more do (a system prompt, a shared document).
        self._held_by: dict[int, int] = {}
        self._holding: dict[int, int] = {}
        self.native = _native is not None  # those two's upkeep and walk in C; False: in Python
        # Seconds of prefill a worker that hands its prompts over may hold (``fit_budget``;
        # 0: its whole budget), set by the core's SLO-aware queueing while the fleet is busy.
        self.hold_s = 0.0
        # Whether the prefill fleet has been busy lately (set by the core with the hold, but
        # not lifted with it): then ``switchyard`` weighs a colocated worker's queue at 0,
        # colocated workers learn factors of their own (``learn_rate``), and their ties no
        # longer spread (``policies.spreads``).
        self.busy = False
        # Whether the colocated workers' decodes have run within half the TPOT SLO lately (set
        # by the core): then ``switchyard`` breaks ties by the KV they decode, least first.
        self.decode_slack = False
        # Placements that computed new blocks (``mark_filled``): the clock of ``filled_at``.
        self.fills = 0
        self.ids: list[str | None] = []  # slot -> worker id
        # Roles whose rates ``learn_rate`` changed and ``rate`` has not yet been rewritten
        # for: their rates are ``factor`` times ``_rate_scale`` (``rate_of``, ``native_rates``).
        self._stale_rates: set[str] = set()
        for name in _ARRAYS:
            setattr(self, name, np.zeros(0))
        self.version = 0  # bumped when a worker joins or leaves
        # Of this version (``_index_slots``): the prefill and decode groups' slots, each role's,
        # and each slot's place in the order of the workers' ids (``id_rank``).
        self._slots: dict[str, npt.NDArray[np.intp]] = {}
        self._role_slots: dict[str, slice | npt.NDArray[np.intp]] = {}
        self._class_slots: dict[tuple[str, str], npt.NDArray[np.intp]] = {}  # (role, device class)
        self._classes: Counter[str] = Counter()  # role -> how many device classes its workers report
        self._rank = np.zeros(0, dtype=np.int64)
        self._slots_version = -1

    def __len__(self) -> int:
        return len(self.workers)

    def __iter__(self) -> Iterator[WorkerState]:
        return iter(self.workers.values())

    def add(self, worker: WorkerState) -> None:
        assert worker.worker_id not in self.workers and worker.fleet is None, worker.worker_id
        self._write_rates()  # before the scales move
        slot = self._free_slot()
        self.ids[slot] = worker.worker_id
        self.workers[worker.worker_id] = worker
        (self.decode if worker.role == "decode" else self.prefill)[worker.worker_id] = worker
        self.roles[worker.role] += 1
        worker.slot = slot
        if worker.shared is not None:
            self.decode_saved += worker.shared.saved
            self.hold_keys(slot, worker.shared.held(), True)
        for name, value in self._row(worker).items():
            getattr(self, name)[slot] = value
        # A worker joins at the rate its role's workers share (it is assumed one of them
        # until its own results say otherwise); the first of a role sets it. Its raw factor
        # is the role's mean, which leaves the others' rates as they were.
        role = worker.role
        if role not in self.shared_rate:
            self.shared_rate[role], self._factor_sum[role], factor = worker.own_rate, 0.0, 1.0
        else:
            factor = self._factor_sum[role] / (self.roles[role] - 1)
        self._factor_sum[role] += factor
        self.factor[slot], self.rate[slot] = factor, self.shared_rate[role]
        worker.fleet = self
        if self.lent and worker.role == "prefill":  # lending is for fleets of colocated workers only
            for lent in list(self.lent):
                self.take_back(lent)
        self._count_capacity()
        self.version += 1

    def _count_capacity(self) -> None:
        """``decode_capacity`` anew: the first decode worker joining, or the last leaving,
        changes what the colocated workers add (``kv_share``)."""
        self.decode_capacity = sum(kv_share(w) for w in self.workers.values())

    def remove(self, worker_id: str) -> WorkerState | None:
        self._write_rates()  # before the scales move
        worker = self.workers.pop(worker_id, None)
        if worker is None:
            return None
        if self.lent.pop(worker_id, None) is None:
            (self.decode if worker.role == "decode" else self.prefill).pop(worker_id)
        if self.lent and not self.prefill:  # the last worker that prefilled is gone: all prefill again
            for lent in list(self.lent):
                self.take_back(lent)
        slot, role = worker.slot, worker.role
        if worker.shared is not None:
            self.decode_saved -= worker.shared.saved
            self.hold_keys(slot, worker.shared.held(), False)
        worker.own_rate = float(self.rate[slot])  # what it leaves with
        scale = self._rate_scale(role)
        self.roles[role] -= 1
        if not self.roles[role]:
            del self.shared_rate[role], self._factor_sum[role]
        else:  # the others' rates as they were: the same scale over the factors left
            self._factor_sum[role] -= self.factor[slot]
            self.shared_rate[role] = scale * self._factor_sum[role] / self.roles[role]
        worker.fleet, worker.slot = None, -1
        self.ids[slot] = None
        for name, free in _ARRAYS.items():
            getattr(self, name)[slot] = free
        self._count_capacity()
        self.version += 1
        return worker

    @property
    def hands_over(self) -> bool:
        """Whether colocated workers hand their decodes over: some are lent to decoding, or
        decode workers serve beside them (a disaggregated fleet whose prefill workers are
        colocated ones, which ``switchyard`` may lend to decoding)."""
        return bool(self.lent) or bool(self.roles["both"] and self.decode)

    def takes_handovers(self, worker: WorkerState) -> bool:
        """Whether ``worker`` decodes what others prefilled: a decode worker, or a lent one."""
        return worker.role == "decode" or worker.worker_id in self.lent

    def lend(self, worker_id: str) -> None:
        """Lend a colocated worker to decoding: no prompt is placed on it from now on."""
        worker = self.prefill.pop(worker_id)
        assert worker.role == "both", worker_id
        self.lent[worker_id] = worker
        self.version += 1

    def take_back(self, worker_id: str) -> None:
        """A lent worker prefills again."""
        self.lent.pop(worker_id)
        back = {w: worker for w, worker in self.workers.items() if w in self.prefill or w == worker_id}
        self.prefill.clear()  # in place, in the order they joined
        self.prefill.update(back)
        self.version += 1

    def mirror(self, worker: WorkerState, name: str, value: Any) -> None:
        """``worker`` is about to set ``name`` to ``value``: keep the arrays and counters."""
        slot = worker.slot
        if name == "load_tokens":
            self.load[slot], self.running[slot] = value, len(worker.assigned)
        elif name == "kv_tokens":
            self.kv[slot], self.holding[slot] = value, len(worker.held)
        elif name == "last_seen":
            self.last_seen[slot] = value
        elif name == "placed_tokens":
            self.placed[slot] = value
        elif name == "room_edge":
            self.room_edge[slot] = value
        elif name == "filled_at":
            self.filled[slot] = value
        elif name == "role":
            assert value == worker.role, "a worker's role is fixed: it registers again under a new one"
        else:  # token_budget, kv_capacity: the decode capacity too
            self.decode_capacity -= kv_share(worker)
            object.__setattr__(worker, name, value)
            self.decode_capacity += kv_share(worker)
            (self.budget if name == "token_budget" else self.kv_cap)[slot] = value

    def mark_filled(self, worker: WorkerState) -> None:
        """A prompt placed on ``worker`` computes new blocks: its cache takes new content
        (and, full, evicts its least recent)."""
        self.fills += 1
        at = worker.__dict__["filled_at"] = float(self.fills)  # and its slot, as ``mirror`` would
        self.filled[worker.slot] = at

    def set_rate(self, worker: WorkerState, rate: float) -> None:
        """Set one worker's prefill rate (its raw factor), leaving the others' as they are."""
        self._write_rates()  # before the scale moves
        role, slot = worker.role, worker.slot
        scale = self._rate_scale(role)
        factor = rate / scale
        self._factor_sum[role] += factor - self.factor[slot]
        self.factor[slot], self.rate[slot] = factor, rate
        self.shared_rate[role] = scale * self._factor_sum[role] / self.roles[role]  # the same scale

    def learn_rate(self, worker: WorkerState, sample: float, weight: float, own_weight: float) -> None:
        """A prefill rate measured on ``worker``. Identical workers measure one rate, each
        sample with its noise: learnt per worker, that noise alone made their rates differ,
        and placement followed it (the faster-looking worker took more, and its queue
        grew). So a worker's rate is its role's shared rate, learnt from every worker's
        samples (``weight``), times a factor of its device class (``device_class``),
        learnt slowly (``own_weight``) from how its samples compare with the shared rate,
        and only where the role's workers report more than one class. Learnt per worker in
        a fleet of identical GPUs, the factors came to tell the workload apart, not the
        hardware: a worker that prefilled whole prompts measured more tokens a second than
        one that computed short suffixes of long cached prefixes (the attention over the
        prefix, the fixed cost of an iteration), looked up to 1.6x faster, took the next
        prompt cached nowhere, and so on (long shared documents, 6 + 2 at light load: two
        workers of six took 80 % of those, and the hit ratio fell from 0.77 to 0.67).
        A colocated worker keeps a factor of its own, learnt while the fleet is busy
        (``busy``): then its prompts share iterations with the sequences it decodes, which
        are its own and last, so its factor measures something of it (pooled, goodput at
        saturation fell 3-6 % on the colocated cases measured). While the fleet is not
        busy its samples move only the shared rate (and its class's factor, as above):
        learnt then, the factor measured the workload again and fed on itself (long shared
        documents, 8 colocated at light load: one worker of eight took 54 % of the prompts
        cached nowhere, hit ratio 0.77 against SGLang's 0.83).

        Factors are kept raw, each worker's relative one being its raw factor over the
        role's mean (so they average 1): one sample changes its class's factors and the
        scale, and the rates are one vector product (made when ``rate`` is next read:
        ``_stale_rates``). On a fleet of unlike GPUs, each kind named, the factors come to
        say which is faster; with one worker, the rate is its own, learnt at ``weight``."""
        # Python floats, not numpy scalars, in the scalar steps: the same IEEE operations on
        # the same values, at a fraction of the cost (this runs once per prefill).
        role, slot, factors = worker.role, worker.slot, self.factor
        factor_sum, n = float(self._factor_sum[role]), self.roles[role]
        mean = factor_sum / n
        old = float(factors[slot])
        relative = old / mean
        shared = (1 - weight) * float(self.shared_rate[role]) + weight * sample / relative
        if role == "both" and self.busy:  # its own factor: what it decodes beside its prompts is its own
            new = ((1 - own_weight) * relative + own_weight * sample / shared) * mean
            factor_sum += new - old
            factors[slot] = new
        elif self._several_classes(role):  # unlike hardware: the worker's class's factor moves
            step = ((1 - own_weight) * relative + own_weight * sample / shared) / relative
            slots = self._class_slots[role, worker.device_class]
            before = float(factors[slots].sum())
            factors[slots] *= step
            factor_sum += before * step - before
        self.shared_rate[role] = shared
        if not 0.5 < mean < 2.0:  # raw factors drift together: bring them back (the rates stay)
            factors[self._slots_of_role(role)] /= mean
            factor_sum /= mean
        self._factor_sum[role] = factor_sum
        # Every rate of the role is now its factor times the new scale: written when next
        # read (``rate``), not once a prefill; the C placement multiplies them as it goes.
        self._stale_rates.add(role)

    @property
    def rate(self) -> npt.NDArray[np.float64]:
        """By slot, the worker's prefill rate (uncached tokens/s)."""
        if self._stale_rates:
            self._write_rates()
        return self._rate

    @rate.setter
    def rate(self, value: npt.NDArray[np.float64]) -> None:
        self._write_rates()
        self._rate = value

    def rate_of(self, worker: WorkerState) -> float:
        """One worker's ``rate``, without writing the others'."""
        slot = worker.slot
        if worker.role in self._stale_rates:
            return float(self.factor[slot]) * self._rate_scale(worker.role)
        return float(self._rate[slot])

    def native_rates(self) -> tuple[npt.NDArray[np.float64], float, float]:
        """For ``_native.choose_prefill``: ``rate`` as last written, and the scale its factor
        is multiplied by for a worker of role ``prefill`` and one of ``both`` whose rate
        is not written yet (NaN: ``rate`` holds it): the same products ``rate`` would hold."""
        stale, nan = self._stale_rates, math.nan
        return (
            self._rate,
            self._rate_scale("prefill") if "prefill" in stale else nan,
            self._rate_scale("both") if "both" in stale else nan,
        )

    def _write_rates(self) -> None:
        stale = self.__dict__.get("_stale_rates")
        if not stale:
            return
        for role in stale:
            slots, scale = self._slots_of_role(role), self._rate_scale(role)
            if isinstance(slots, slice):
                np.multiply(self.factor[slots], scale, out=self._rate[slots])
            else:
                self._rate[slots] = self.factor[slots] * scale
        stale.clear()

    def _rate_scale(self, role: str) -> float:
        """A worker's prefill rate over its raw factor, for workers of ``role``."""
        return self.shared_rate[role] * self.roles[role] / self._factor_sum[role]

    def _slots_of_role(self, role: str) -> slice | npt.NDArray[np.intp]:
        """The slots of ``role``'s workers: a slice where they are contiguous (a view, so the
        rates are written in place), else an index array."""
        self._index_slots()
        return self._role_slots[role]

    def _several_classes(self, role: str) -> bool:
        """Whether ``role``'s workers report more than one device class: only there is a
        class's factor learnt (``learn_rate``)."""
        self._index_slots()
        return self._classes[role] > 1

    def slots(self, group: str) -> npt.NDArray[np.intp]:
        """The slots of the ``prefill`` or ``decode`` workers, in slot order."""
        self._index_slots()
        return self._slots[group]

    def _index_slots(self) -> None:
        if self._slots_version == self.version:
            return
        prefill = [w.slot for w in self.prefill.values()]
        decode = [w.slot for w in self.decode.values()]
        self._slots = {
            "prefill": np.sort(np.array(prefill, dtype=np.intp)),
            "decode": np.sort(np.array(decode, dtype=np.intp)),
        }
        by_role: dict[str, list[int]] = {}
        by_class: dict[tuple[str, str], list[int]] = {}
        for w in self.workers.values():
            by_role.setdefault(w.role, []).append(w.slot)
            by_class.setdefault((w.role, w.device_class), []).append(w.slot)
        self._class_slots = {key: np.array(taken, dtype=np.intp) for key, taken in by_class.items()}
        self._classes = Counter(role for role, _ in by_class)
        self._role_slots = {}
        for role, taken in by_role.items():
            taken.sort()
            contiguous = taken[-1] - taken[0] + 1 == len(taken)
            self._role_slots[role] = slice(taken[0], taken[-1] + 1) if contiguous else np.array(taken, dtype=np.intp)
        self._rank = np.full(len(self.ids), len(self.ids), dtype=np.int64)
        ranked = sorted((wid, slot) for slot, wid in enumerate(self.ids) if wid is not None)
        self._rank[[slot for _, slot in ranked]] = np.arange(len(ranked), dtype=np.int64)
        self._slots_version = self.version

    def fit_budget(self) -> npt.NDArray[np.float64]:
        """By slot, the budget a prompt must fit (``load == 0 or load + need <= it``): the
        worker's own, or with ``hold_s`` set, at most ``hold_s`` of prefill at its rate for
        a worker that hands its prompts over to others to decode (role ``prefill``, and
        colocated ones while they hand over, ``hands_over``). So their queues stay short and what waits,
        waits in the core's queue, where shorter prompts go first; a prompt longer than
        that runs on such a worker once it is idle."""
        if self.hold_s <= 0:
            return self.budget
        handing_over = (self.colocated == 0) | self.hands_over
        held: npt.NDArray[np.float64] = np.where(
            handing_over, np.minimum(self.budget, self.hold_s * self.rate), self.budget
        )
        return held

    def decode_sharing(self, spec: RequestSpec) -> npt.NDArray[np.int32] | None:
        """By slot, the tokens of ``spec``'s prompt that decodes there already hold
        (``WorkerState.sharing`` for every worker at once, from the bitsets: whoever holds
        a block holds the ones before it); None where none holds its first block."""
        keys, holders = spec.block_keys, self.holders
        if self.native:
            out = np.zeros(len(self.ids), dtype=np.int32)
            found = _native.decode_sharing(self._held_by, self._holding, keys, spec.block_size, out)
            return out if found else None
        mask = holders(keys[0]) if keys else 0
        if not mask:
            return None
        stopped: list[tuple[int, int]] = []  # (slots whose run ends at, blocks)
        for depth, key in enumerate(keys[1:], 1):
            deeper = mask & holders(key)
            if deeper != mask:
                stopped.append((mask & ~deeper, depth))
                if not deeper:
                    break
            mask = deeper
        else:
            stopped.append((mask, len(keys)))
        return by_slot(stopped, len(self.ids)) * spec.block_size

    def hold_keys(self, slot: int, keys: list[int], held: bool) -> None:
        """Decodes on ``slot`` hold ``keys`` from now on (``held``; none held them there), or
        no longer do (none holds them there any more)."""
        holding, held_by = self._holding, self._held_by
        if self.native:
            _native.hold_keys(held_by, holding, slot, keys, held)
            return
        if held:
            for key in keys:
                other = held_by.pop(key, None)
                if other is not None:
                    holding[key] = 1 << other | 1 << slot
                elif key in holding:
                    holding[key] |= 1 << slot
                else:
                    held_by[key] = slot
            return
        for key in keys:
            if held_by.get(key) == slot:
                del held_by[key]
                continue
            mask = holding[key] & ~(1 << slot)
            if mask & (mask - 1):
                holding[key] = mask
            else:  # one holder left
                del holding[key]
                held_by[key] = mask.bit_length() - 1

    def holders(self, key: int) -> int:
        """The slots whose decodes hold ``key``, a bitset."""
        one = self._held_by.get(key)
        return self._holding.get(key, 0) if one is None else 1 << one

    def fits_held(self, worker: WorkerState, tokens: int) -> bool:
        """Whether ``tokens`` more fit ``worker`` within ``fit_budget`` (the ledger check of
        ``WorkerState.fits``, with the hold)."""
        load = worker.load_tokens
        return load == 0 or load + tokens <= self.fit_budget()[worker.slot]

    def id_rank(self) -> npt.NDArray[np.int64]:
        """By slot, the worker's place among the fleet's ids in sorted order (a free slot
        ranks past them all): the lower rank of two is the lower id, as ``lowest_id`` picks."""
        self._index_slots()
        return self._rank

    def excuse(self, unheard_s: float, now: float) -> None:
        """Count none of the last ``unheard_s`` as any worker's silence: each was last seen
        that much later, never later than ``now``."""
        for worker in self.workers.values():
            worker.touch(min(now, worker.last_seen + unheard_s))

    def expired(self, now: float, expiry_s: float) -> list[WorkerState]:
        """Workers last seen more than ``expiry_s`` ago, in the order they joined."""
        late = np.flatnonzero(now - self.last_seen > expiry_s)
        if not len(late):
            return []
        names = {self.ids[s] for s in late.tolist()}
        return [w for w in self.workers.values() if w.worker_id in names]

    def _free_slot(self) -> int:
        for slot, wid in enumerate(self.ids):  # joins are rare: a scan is fine
            if wid is None:
                return slot
        slot = len(self.ids)
        grow = max(16, slot)
        self.ids += [None] * grow
        for name, free in _ARRAYS.items():
            setattr(self, name, np.concatenate([getattr(self, name), np.full(grow, free)]))
        return slot

    @staticmethod
    def _row(worker: WorkerState) -> dict[str, float]:
        return {
            "load": worker.load_tokens,
            "running": len(worker.assigned),
            "kv": worker.kv_tokens,
            "holding": len(worker.held),
            "rate": worker.prefill_rate,
            "budget": worker.token_budget,
            "kv_cap": worker.kv_capacity,
            "colocated": float(worker.role == "both"),
            "last_seen": worker.last_seen,
            "placed": worker.placed_tokens,
            "room_edge": worker.room_edge,
            "filled": worker.filled_at,
        }

    def check_invariants(self) -> None:
        assert self.roles == Counter(w.role for w in self.workers.values()), self.roles
        assert set(self.workers) == set(self.prefill) | set(self.decode) | set(self.lent)
        assert len(self.workers) == len(self.prefill) + len(self.decode) + len(self.lent)
        assert self.prefill or not self.lent, "lent workers and none that prefills"
        assert not self.lent or not self.roles["prefill"], "lent workers beside prefill workers"
        assert self.decode_capacity == sum(kv_share(w) for w in self.workers.values())
        assert self.decode_saved == sum(w.shared.saved for w in self.workers.values() if w.shared is not None)
        holding: dict[int, int] = {}
        for w in self.workers.values():
            for key in w.shared.held() if w.shared is not None else ():
                holding[key] = holding.get(key, 0) | 1 << w.slot
        assert holding == {key: self.holders(key) for key in [*self._held_by, *self._holding]}
        assert not set(self._held_by) & set(self._holding)
        assert all(mask & (mask - 1) for mask in self._holding.values())  # two or more holders
        assert set(self.shared_rate) == set(self.roles.elements()), self.shared_rate
        for role, n in self.roles.items():
            if n:
                factors = [self.factor[w.slot] for w in self.workers.values() if w.role == role]
                assert math.isclose(self._factor_sum[role], sum(factors), rel_tol=1e-9), role
                kinds: dict[str, list[int]] = {}
                for w in self.workers.values():
                    if w.role == role:
                        kinds.setdefault(w.device_class, []).append(w.slot)
                assert self._several_classes(role) == (len(kinds) > 1), role
                for kind, taken in kinds.items():
                    assert sorted(self._class_slots[role, kind]) == sorted(taken), (role, kind)
        for worker in self.workers.values():
            slot = worker.slot
            assert worker.fleet is self and self.ids[slot] == worker.worker_id, worker.worker_id
            rate = self._rate_scale(worker.role) * self.factor[slot]
            assert math.isclose(self.rate[slot], rate, rel_tol=1e-9), worker.worker_id
            for name, value in self._row(worker).items():
                assert getattr(self, name)[slot] == value, (worker.worker_id, name)
        taken, rank = [s for s, w in enumerate(self.ids) if w is not None], self.id_rank()
        assert sorted(taken, key=lambda s: self.ids[s] or "") == sorted(taken, key=lambda s: rank[s])
        for slot in (s for s, w in enumerate(self.ids) if w is None):
            assert all(getattr(self, name)[slot] == free for name, free in _ARRAYS.items()), slot


def lowest_id(fleet: Fleet, slots: npt.NDArray[np.intp] | list[int]) -> WorkerState:
    """The worker of ``slots`` with the lowest id: the policies' tie-break."""
    ids = (fleet.ids[s] for s in (slots.tolist() if isinstance(slots, np.ndarray) else slots))
    return fleet.workers[min(w for w in ids if w is not None)]
