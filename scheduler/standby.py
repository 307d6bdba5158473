"""What a standby scheduler keeps, so that taking over loses no request.

The requests an active scheduler holds that no worker holds yet (queued, waiting for
decode) exist nowhere else: a scheduler that takes over cannot learn them from the
workers' roll call. So a standby hears what the active one hears and answers: every
submit (a plain subscription, not a queue group: only the lease holder answers), the
answer to each (the submitter's reply subject is in the submit; a standby listens on
``_INBOX.>`` and looks each message's subject up, nothing more), every worker event and
every cancel. It keeps each submit (``SubmitShadow``: the message as it came, a few bytes
per prompt token, within ``max_bytes``, the oldest dropped first) until a refusal, a
worker's event or a cancel says the request ended.

When it takes over, after the workers answered its roll call, each request it kept is
(``settlement``):
- ``adopted``: a worker holds it; it gets its prompt (the roll call carries none);
- ``decode``: prefilled (its ``PrefillDone`` was heard) and held by no decode worker: it
  was waiting for decode, and waits here, from the very handle and token 0 it had;
- ``queue``: admitted and not yet placed: it was queued, and is queued here, in its turn
  and with no second admission;
- ``admit``: never answered (the old one died first): admitted now, answered late.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import msgspec

from switchyard.schemas import Admitted, Cancel, PrefillDone, Rejected, codec

Settlement = Literal["adopted", "decode", "queue", "admit"]


@dataclass(frozen=True, slots=True)
class Shadowed:
    request_id: str
    data: bytes  # the SubmitRequest as sent
    reply: str | None  # where its submitter waits (or waited) for the answer
    headers: dict[str, str]
    received_at: float
    attempt: int = 0  # the spec's: a cancel of earlier attempts leaves this one kept


@dataclass(frozen=True, slots=True)
class Kept:
    """A kept submit, and what was heard of it since."""

    entry: Shadowed
    admitted: bool
    prefill: PrefillDone | None


class SubmitShadow:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, Shadowed] = OrderedDict()
        self._bytes = 0
        self.evicted = 0  # dropped for room: such a request, if still waiting, times out
        self._workers: dict[str, float] = {}  # worker -> last heard
        self._waiting: dict[str, str] = {}  # reply subject -> request, not answered yet
        self._admitted: set[str] = set()
        self._prefilled: dict[str, PrefillDone] = {}

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size(self) -> int:
        return self._bytes

    def submitted(self, entry: Shadowed) -> None:
        self.ended(entry.request_id)
        self._entries[entry.request_id] = entry
        if entry.reply:
            self._waiting[entry.reply] = entry.request_id
        self._bytes += len(entry.data)
        while self._bytes > self.max_bytes and self._entries:
            self.evicted += 1
            self.ended(next(iter(self._entries)))

    def answered(self, subject: str, data: bytes) -> None:
        """A message on some inbox: the active scheduler's answer to a kept submit, or not ours."""
        rid = self._waiting.pop(subject, None)
        if rid is None:
            return
        try:
            reply = codec.SCHEDULER_REPLY.decode(data)
        except msgspec.DecodeError:
            return
        match reply:
            case Admitted():
                self._admitted.add(rid)
            case Rejected():
                self.ended(rid)

    def prefilled(self, done: PrefillDone) -> None:
        """Its token 0 is out and its KV handed over: next, a decode worker (or its end)."""
        if done.finished:
            self.ended(done.request_id)
        elif done.request_id in self._entries:
            self._prefilled[done.request_id] = done

    def ended(self, request_id: str) -> None:
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        self._bytes -= len(entry.data)
        if entry.reply:
            self._waiting.pop(entry.reply, None)
        self._admitted.discard(request_id)
        self._prefilled.pop(request_id, None)

    def cancelled(self, cancel: Cancel) -> None:
        """A cancel ends the kept submit only if it covers the kept attempt: the ingress
        cancels a run before it submits the next attempt of the request, and the active
        scheduler's audit cancels a worker's stray run of an earlier attempt."""
        entry = self._entries.get(cancel.request_id)
        if entry is not None and cancel.covers(entry.attempt):
            self.ended(cancel.request_id)

    def get(self, request_id: str) -> Shadowed | None:
        return self._entries.get(request_id)

    def worker_heard(self, worker_id: str, now: float) -> None:
        self._workers[worker_id] = now

    def worker_left(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)

    def live_workers(self, now: float, expiry_s: float) -> set[str]:
        """Workers heard within ``expiry_s``: those whose roll-call answers a takeover awaits."""
        return {w for w, at in self._workers.items() if now - at <= expiry_s}

    def take(self) -> list[Kept]:
        """Every request kept, in arrival order; the shadow is empty after."""
        kept = [Kept(e, rid in self._admitted, self._prefilled.get(rid)) for rid, e in self._entries.items()]
        self._entries.clear()
        self._waiting.clear()
        self._admitted.clear()
        self._prefilled.clear()
        self._bytes = 0
        return kept


def settlement(known: bool, prefilled: bool, admitted: bool) -> Settlement:
    """What a scheduler taking over does with a submit its standby kept (see the note)."""
    if known:
        return "adopted"
    if prefilled:
        return "decode"
    return "queue" if admitted else "admit"
