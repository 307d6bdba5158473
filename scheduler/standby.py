"""What a standby scheduler keeps, so that taking over loses no request silently.

The requests an active scheduler holds that no worker holds yet (queued, waiting for
decode) exist nowhere else: a scheduler that takes over cannot learn them from the
workers' roll call. So every replica hears every submit (a plain subscription, not a
queue group: only the lease holder answers), and a standby keeps each one it heard
(``SubmitShadow``) until a worker's event or a cancel says the request ended. It keeps
the message as it came (bytes: a few per prompt token) within ``max_bytes``, the oldest
dropped first.

When it takes over, after the workers answered its roll call, each request it kept is
(``settlement``) either ours already (a worker held it: adopted, and now given its
prompt); or prefilled (its ``PrefillDone`` was heard) and held by no decode worker: it
was waiting for decode, and its decode is placed now, from the very handle and token 0
the old scheduler had; or heard after this replica acquired the lease, when the old
active one had certainly stopped: nobody answered it, and it is admitted now, answered
late; or it may have been answered, queued, rejected or failed by the old one, which we
cannot tell apart: its stream is failed at once with ``scheduler_failover`` and its
submitter, if it still waits, gets a 429 with a Retry-After of a second (a clean error
the client can retry, instead of a stream that waits for its idle timeout).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

from switchyard.schemas import PrefillDone

Settlement = Literal["adopted", "decode", "admit", "fail"]


@dataclass(frozen=True, slots=True)
class Shadowed:
    request_id: str
    data: bytes  # the SubmitRequest as sent
    reply: str | None  # where its submitter waits (or waited) for the answer
    headers: dict[str, str]
    received_at: float


class SubmitShadow:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Shadowed] = OrderedDict()
        self._bytes = 0
        self.evicted = 0  # dropped for room: such a request, if still waiting, times out
        self._workers: dict[str, float] = {}  # worker -> last heard
        self._prefilled: dict[str, PrefillDone] = {}  # kept requests whose prefill was done

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._bytes

    def submitted(self, entry: Shadowed) -> None:
        self.ended(entry.request_id)
        self._entries[entry.request_id] = entry
        self._bytes += len(entry.data)
        while self._bytes > self.max_bytes and self._entries:
            _, oldest = self._entries.popitem(last=False)
            self._bytes -= len(oldest.data)
            self._prefilled.pop(oldest.request_id, None)
            self.evicted += 1

    def ended(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is not None:
            self._bytes -= len(entry.data)
        self._prefilled.pop(request_id, None)

    def prefilled(self, done: PrefillDone) -> None:
        """Its token 0 is out and its KV handed over: next, a decode worker (or its end)."""
        if done.finished:
            self.ended(done.request_id)
        elif done.request_id in self._entries:
            self._prefilled[done.request_id] = done

    def get(self, request_id: str) -> Shadowed | None:
        return self._entries.get(request_id)

    def worker_heard(self, worker_id: str, now: float) -> None:
        self._workers[worker_id] = now

    def worker_left(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def live_workers(self, now: float, expiry_s: float) -> set[str]:
        """Workers heard within ``expiry_s``: those whose roll-call answers a takeover awaits."""
        return {w for w, at in self._workers.items() if now - at <= expiry_s}

    def take(self) -> list[Shadowed]:
        """Every request kept, in arrival order; the shadow is empty after."""
        entries = list(self._entries.values())
        self._entries.clear()
        self._bytes = 0
        return entries

    def take_prefilled(self) -> dict[str, PrefillDone]:
        prefilled, self._prefilled = self._prefilled, {}
        return prefilled


def settlement(entry: Shadowed, known: bool, prefilled: bool, acquired_at: float) -> Settlement:
    """What a scheduler taking over does with a submit its standby kept (see the note)."""
    if known:
        return "adopted"
    if prefilled:
        return "decode"
    return "admit" if entry.received_at > acquired_at else "fail"
