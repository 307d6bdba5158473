"""After the bus may have lost messages, the requests no worker holds any more.

Core NATS delivers at most once: a nats-server restart loses what was in flight, and a
slow consumer's overflow is dropped. A lost ``PrefillDone`` leaves a request in prefill
for ever; a lost ``RequestFinished`` leaves its KV tokens on a decode worker's ledger for
ever; both strand budget. So when the scheduler's connection came back, or it dropped
messages, it audits: it notes every request placed on a worker whose task that worker
acknowledged, and rolls call under its own id (no worker treats that as a new scheduler).
Each worker answers with every request it holds. A request the worker acknowledged
before the roll call and no longer holds has ended there, and the message saying how
was lost: the scheduler forgets it and hands it to its ingress as ``worker_lost`` (a
stream that had ended is gone at the ingress already; one that had not continues
elsewhere, ``ingress.generation``). The other way round, a request the worker holds and
the scheduler no longer tracks (``strays``) ended for the scheduler, and its cancel was
lost on the way to the worker (a client that left, a stream the ingress migrated while
the worker reconnected): the worker would decode it to its end for nobody, holding KV the
scheduler's ledger counts as free. The scheduler cancels that run, and does not adopt it
as it adopts a previous scheduler's requests (``SchedulerCore``). An acknowledgement precedes the roll call and the
worker's answer follows the roll call, so a task still on its way is never taken for
lost; a worker that does not answer is left to its heartbeat's expiry. Workers come back
at their own pace (each client retries every 0.2 s), so one may reconnect after the roll
call: it is asked again once the first answers had time to come (``asked_again``), and the
audit ends as long after that. What a worker said it held in either answer counts.

Pure: time is passed in, the service publishes the roll call and applies the result.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass, field

from switchyard.schemas import HeldRequest, LoadReport


@dataclass
class Audit:
    asked_at: float
    placed: dict[str, str]  # request -> the worker that acknowledged its task
    held: dict[str, set[str]] = field(default_factory=dict)  # worker -> what it said it holds
    asked_again: bool = False  # the second roll call, for workers that reconnected after the first

    def heard(self, report: LoadReport) -> None:
        """One part of a worker's answer (a long list comes in several reports)."""
        if report.held is not None:
            self.held.setdefault(report.worker_id, set()).update(h.request_id for h in report.held)

    @staticmethod
    def strays(report: LoadReport, tracked: Container[str]) -> list[HeldRequest]:
        """What the worker answered it holds that the scheduler does not track (``tracked``:
        request ids): runs whose cancel it missed."""
        return [h for h in report.held or [] if h.request_id not in tracked]

    def lost(self) -> list[tuple[str, str]]:
        """(request, worker) for each placed request its worker answered without."""
        return [
            (rid, worker) for rid, worker in self.placed.items() if worker in self.held and rid not in self.held[worker]
        ]


__all__ = ["Audit"]
