"""Colocated workers lent to decoding: disaggregation chosen by the fleet's own load.

A colocated worker that decodes while it prefills makes every sequence it decodes wait
through each prefill iteration (vLLM's chunked prefill puts the prompt's tokens and the
decode tokens in one batch), so time per output token grows with the worker's prefill
share. Under load that is what bounds a colocated fleet, whatever the placement: on the
Azure trace at its peak every policy decodes at a p90 of 86-88 ms a token against a 50 ms
SLO, while the same eight GPUs split 6+2 serve nearly twice the requests.

So with a TPOT SLO (``tpot_slo_s``) the ``switchyard`` policy lends colocated workers to
decoding when decodes run slow, one at a time: a lent worker takes no prompt the policy places
(``Fleet.lend``), and the other workers hand each request they prefill over to the lent
ones (a ``PrefillTask``: prefill, then KV handoff) instead of decoding it themselves (a
``LocalTask``). A worker is lent when the decodes finishing lately ran slower than
``_SLOW`` of the SLO: the colocated ones while none is lent, the lent ones once some are.
Not while the decodes are still within the SLO and requests wait late for prefill
capacity: then the prefill side needs its workers more. One is taken back when the lent
workers decode well within the SLO (``_QUICK``) while requests wait late for prefill.
Each change waits for a decode's length (the core's learned decode duration) before the
next, so the decodes it measures ran under it. At least one worker always prefills.

The lent workers' time per token says nothing of the decodes that found no room on them:
``pick_decode`` hands those to a colocated worker, where they decode between prefill
iterations, several times over the SLO, while the lent ones run quick and no other worker
is lent. So a worker is lent too when more than ``_SPILL_SHARE`` of the decodes handed over
since the last change (at least ``_SPILL_MIN`` of them) went to a colocated worker
(``observe_handover``), and none is taken back while any has since the last change. On
bursty conversations, colocated, past saturation, one worker stayed lent for a whole run
while 2,853 of 5,226 handed-over decodes went to colocated workers, whose decodes ran at a
median of 140 ms a token (``docs/bench-sim.md``, "Decodes that find no room on the lent
workers").

Beside decode workers (``Fleet.hands_over``: a disaggregated fleet whose prefill workers are
colocated ones) the decode workers count as lent from the start: the colocated workers hand
every decode over, the decode workers' decodes are what lends one of them, and a handover
goes to the decode or lent worker decoding fewest. The prefill workers' spare time is then
what the decode side borrows when it runs slow. On tool agents, 6 + 2, the two decode
workers were busy 98-99 % of the time at the peak while the six prefill workers were busy
55 %: lending them took the peak from 22.72 to 26.32 requests/s (``docs/bench-sim.md``,
"Prefill workers lent to decoding"). One is taken back only if the decodes would stay under
``_SLOW`` with one taker fewer (``_stays_quick``): two decode workers and one lent, quick,
would otherwise give it back and lend it again a decode later. On a fleet with spare time, a
one-step answer prefilled on an idle colocated worker decodes there when its whole handoff
would cost its TPOT (``keeps_idle_local``; ``SchedulerCore._decodes_in_place``): at light load
on tool agents that took the TPOT misses of 2-token answers from 13 to 3 (seed 2: 23 to 8).

While the lent workers' decodes run under ``_LANE`` of the SLO they also take short
prompts (the core's short-prompt lane, ``SchedulerCore._lent_lane``): under a burst the
prefill workers queue long prompts, and a short one behind them waits through whole
prefill iterations, while on a lent worker it waits one decode step and stalls those
decodes once. What the lane costs the lent decodes shows in the same measure, which closes
it below ``_SLOW``, before it would lend another worker.

The time per output token of a finished decode is its decode time over its tokens after
the first, as the core sees it (from its placement to its ``RequestFinished``): a
request's whole decode, not its worker's state now. Averaged over about
``1 / _WEIGHT`` decodes, per group (lent or not).

Handing a request over is not free: its KV crosses to the lent worker before the first
decode step there, and a long prompt's transfer spread over a short answer is a slow time
per token by itself (a 40,000-token prompt and a 5-token answer: ~130 ms of handoff, 33
ms a token on a 50 ms SLO). Disaggregation is chosen per request (``keeps_local``): a
request whose handoff, at the rate measured on the lent workers (``observe_handoff``: how
a handed-over decode's time from its placement to its first step there grows with its
prompt), would cost more than ``_LOCAL_SHARE`` of the TPOT SLO a token of its
``max_tokens`` decodes where it was prefilled, as it would with none lent. Until a
handoff was measured every request is handed over.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.state import Fleet, WorkerState, shareable_keys
from switchyard.schemas import RequestSpec

_SLOW = 0.85  # lend another worker when decodes take more than this share of the SLO...
_QUICK = 0.6  # ...take one back when the lent ones take less, and prefill is short
_LANE = 0.8  # ...and give the lent ones short prompts while their decodes take less
_WEIGHT = 0.05
# A request decodes where it was prefilled when its handoff would cost more than this share of
# the TPOT SLO a token. 0.1 and 0.25 gave the same within 3 % on every colocated case
# (docs/bench-sim.md, "Decodes of one prompt kept together; handed over only where ...").
_LOCAL_SHARE = 0.25
_HANDOFF_WEIGHT = 0.02  # the handoff's line: averaged over about 50 handovers
# Lend another worker when more than this share of the decodes handed over since the last
# change went to a colocated worker (none lent had room), once that many were handed over.
# 0.5 rarely fired; 0.1 and 0.2 gave within 3 % of each other (the docs' section).
_SPILL_SHARE = 0.2
_SPILL_MIN = 20


class Lending:
    def __init__(self, config: SchedulerConfig) -> None:
        self.slo_s = config.tpot_slo_s
        self.tpot = {True: 0.0, False: 0.0}  # by lent or not: the decodes' recent TPOT
        self._seen = {True: False, False: False}
        self._changed_at = -math.inf
        self.lent_total = 0  # lendings so far, and takings back
        self.taken_back = 0
        # Averages of (prompt tokens, seconds to the first step, their squares and product) of
        # handed-over decodes (``observe_handoff``).
        self._handoff: tuple[float, float, float, float] | None = None
        self._handed = self._spilled = 0  # decodes handed over since the last change, and to colocated workers

    def observe_handover(self, to_lent: bool) -> None:
        """A decode was handed over while workers are lent: to a lent one, or to a colocated
        worker (``pick_decode`` found no lent one with room)."""
        self._handed += 1
        self._spilled += not to_lent

    def observe_handoff(self, first_step_s: float, prompt_tokens: int) -> None:
        """A decode handed over to a lent worker took ``first_step_s`` from its placement to
        its first step there (the KV handoff, and joining a step), for a prompt of
        ``prompt_tokens``. Kept as running averages of a line through those points
        (``handoff_s_per_token``: its slope), since only the part that grows with the prompt
        is the handoff's own: a local decode joins a step too."""
        if not (0 <= first_step_s < math.inf) or prompt_tokens <= 0:
            return
        x, y = float(prompt_tokens), first_step_s
        point = (x, y, x * x, x * y)
        if self._handoff is None:
            self._handoff = point
        else:
            self._handoff = tuple(  # type: ignore[assignment]
                (1 - _HANDOFF_WEIGHT) * a + _HANDOFF_WEIGHT * b for a, b in zip(self._handoff, point, strict=True)
            )

    def handoff_s_per_token(self) -> float | None:
        """Seconds of handoff a prompt token (the slope of the line through the handoffs
        measured lately); None before prompts of different lengths were measured."""
        if self._handoff is None:
            return None
        x, y, xx, xy = self._handoff
        spread = xx - x * x
        if spread <= 1e-9 * xx:
            return None
        return max(0.0, (xy - x * y) / spread)

    def keeps_local(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request prefilled on a colocated worker not lent decodes there: its
        handoff over its answer would cost more than ``_LOCAL_SHARE`` of the TPOT SLO a token."""
        per_token = self.handoff_s_per_token()
        if self.slo_s <= 0 or per_token is None:
            return False
        return prompt_tokens * per_token / max(1, max_tokens - 1) > _LOCAL_SHARE * self.slo_s

    def keeps_idle_local(self, prompt_tokens: int, max_tokens: int) -> bool:
        """Whether a request prefilled on an idle colocated worker decodes there: its whole
        handoff (the line through the handoffs measured lately, at its prompt: the report,
        the transfer and the step it joins on the taker) over its answer would cost more than
        ``_LOCAL_SHARE`` of the TPOT SLO a token. An idle worker steps it at once."""
        if self.slo_s <= 0 or self._handoff is None:
            return False
        x, y = self._handoff[0], self._handoff[1]
        handoff_s = y + (self.handoff_s_per_token() or 0.0) * (prompt_tokens - x)
        return handoff_s / max(1, max_tokens - 1) > _LOCAL_SHARE * self.slo_s

    def observe(self, lent: bool, tpot_s: float) -> None:
        if self._seen[lent]:
            self.tpot[lent] = (1 - _WEIGHT) * self.tpot[lent] + _WEIGHT * tpot_s
        else:
            self.tpot[lent], self._seen[lent] = tpot_s, True

    def decide(self, fleet: Fleet, prefill_short: Callable[[], bool], settle_s: float, now: float) -> str | None:
        """Lend a worker or take one back; the worker changed, or None. ``prefill_short``:
        whether requests wait late for prefill capacity (asked only when it matters)."""
        if self.slo_s <= 0 or now - self._changed_at < settle_s:
            return None
        lent = fleet.hands_over  # the decodes of the workers that take handovers, once any do
        tpot = self.tpot[lent]
        # Slow decodes lend a worker; if they are still within the SLO while requests wait
        # late for prefill, the prefill side needs its workers more, and none is lent. Decodes
        # spilled to colocated workers lend one whatever prefill does: each misses the SLO.
        slow = self._seen[lent] and tpot > _SLOW * self.slo_s
        spill = lent and self._handed >= _SPILL_MIN and self._spilled > _SPILL_SHARE * self._handed
        if (spill or slow) and len(fleet.prefill) > 1 and (spill or tpot > self.slo_s or not prefill_short()):
            worker = _to_lend(fleet)
            if worker is not None:
                fleet.lend(worker.worker_id)
                self.lent_total += 1
                return self._changed(worker, now)
        # Not while decodes spill: the one taken back would make more of them spill.
        if (
            fleet.lent
            and not self._spilled
            and self._seen[True]
            and self.tpot[True] < _QUICK * self.slo_s
            and self._stays_quick(fleet)
            and prefill_short()
        ):
            worker = min(fleet.lent.values(), key=lambda w: (len(w.held), w.worker_id))
            fleet.take_back(worker.worker_id)
            self.taken_back += 1
            return self._changed(worker, now)
        return None

    def _stays_quick(self, fleet: Fleet) -> bool:
        """Beside decode workers: whether the decodes would still run under ``_SLOW`` of the
        SLO with one taker fewer, their load spread over the rest (a step's time taken as
        its sequences'). Two decode workers and one lent: taking it back puts half as much
        again on each, and the next decodes lend it again (on tool agents, 6 + 2, at the
        peak: 9 lendings and 8 takings back in 720 s)."""
        if not fleet.decode:
            return True  # colocated: what the lent decodes measure after a take-back differs in kind
        takers = len(fleet.decode) + len(fleet.lent)
        return self.tpot[True] * takers / (takers - 1) < _SLOW * self.slo_s

    def lane_open(self) -> bool:
        """Whether the lent workers' decodes have room for prompts of their own: measured
        since the last change, and under ``_LANE`` of the SLO."""
        return self.slo_s > 0 and self._seen[True] and self.tpot[True] < _LANE * self.slo_s

    def _changed(self, worker: WorkerState, now: float) -> str:
        self._changed_at = now
        self._seen = {True: False, False: False}  # measured afresh, under the new split
        self._handed = self._spilled = 0
        return worker.worker_id


def _to_lend(fleet: Fleet) -> WorkerState | None:
    """The colocated prefill worker with the most decodes (the fewest prompts on its ledger
    between equals): the one lending costs the least prefill and the most decodes gain."""
    both = [w for w in fleet.prefill.values() if w.role == "both"]
    if not both:
        return None
    return min(both, key=lambda w: (-len(w.held), w.load_tokens, w.worker_id))


def pick_decode(fleet: Fleet, tokens: int, spec: RequestSpec | None = None) -> WorkerState | None:
    """Where a fleet of colocated workers decodes a handed-over request: the worker with room
    that takes handovers (lent, or a decode worker beside them) and decodes the fewest
    sequences; with none, the colocated worker with room that has the fewest prompt tokens
    on its ledger (then the fewest decodes). Room for its KV less the prompt blocks decodes
    there already hold (``WorkerState.hold_decode``; a decode worker's ledger, ``fits``)."""

    def room(w: WorkerState) -> bool:
        need = tokens - (w.sharing(shareable_keys(spec, w)) if spec is not None else 0)
        return w.fits(need) if w.role == "decode" else w.kv_room(need)

    takers = [w for w in (*fleet.lent.values(), *fleet.decode.values()) if room(w)]
    if takers:
        return min(takers, key=lambda w: (len(w.assigned if w.role == "decode" else w.held), w.worker_id))
    both = [w for w in fleet.prefill.values() if w.role == "both" and room(w)]
    return min(both, key=lambda w: (w.load_tokens, len(w.held), w.worker_id)) if both else None


def lane_worker(fleet: Fleet, tokens: int) -> WorkerState | None:
    """The lent worker to prefill a short prompt and decode it: one with no prompt on its
    ledger (one at a time, so its decodes stall for at most one such prompt a step) and
    room for its KV; of those, the one decoding fewest."""
    free = [w for w in fleet.lent.values() if not w.load_tokens and w.kv_room(tokens)]
    return min(free, key=lambda w: (len(w.held), w.worker_id)) if free else None


__all__ = ["Lending", "lane_worker", "pick_decode"]
