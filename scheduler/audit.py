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
elsewhere, ``ingress.generation``). An acknowledgement precedes the roll call and the
worker's answer follows the roll call, so a task still on its way is never taken for
lost; a worker that does not answer is left to its heartbeat's expiry.

Pure: time is passed in, the service publishes the roll call and applies the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.schemas import LoadReport


@dataclass
class Audit:
    asked_at: float
    placed: dict[str, str]  # request -> the worker that acknowledged its task
    held: dict[str, set[str]] = field(default_factory=dict)  # worker -> what it said it holds

    def heard(self, report: LoadReport) -> None:
        """One part of a worker's answer (a long list comes in several reports)."""
        if report.held is not None:
            self.held.setdefault(report.worker_id, set()).update(h.request_id for h in report.held)

    def lost(self) -> list[tuple[str, str]]:
        """(request, worker) for each placed request its worker answered without."""
        return [
            (rid, worker) for rid, worker in self.placed.items() if worker in self.held and rid not in self.held[worker]
        ]


__all__ = ["Audit"]
