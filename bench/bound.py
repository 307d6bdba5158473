"""``switchyard bench bound``: the most goodput a trace's decode side can give, from the
simulator's cost model, whatever the placement.

    switchyard bench bound --trace /tmp/toolagent.jsonl --decode 2 --peer-goodput 19.92 --out /tmp/bound

On a fleet whose decode workers are its bottleneck, placement moves goodput only between
requests that keep their SLOs and requests that miss them; past a point no policy can serve
more. This computes that point, so that a goal above it is known to be out of reach before a
sweep is run (on tool agents 6 + 2, ``docs/bench-sim.md``, "What two decode workers can
serve at most").

A decode step of ``n`` sequences holding ``kv`` tokens takes ``base + per_seq * n + per_kv *
kv`` (``CostModel.iteration_s`` with no prompt). A worker stepping in ``S`` seconds so holds
``N(S) = (S - base) / (per_seq + per_kv * ctx)`` sequences, where ``ctx`` is the KV a
sequence of the trace holds while it decodes (its prompt and half its answer, weighted by
its answer's steps), and gives ``N(S) / S`` tokens a second. An answer of ``n`` tokens takes
``n - 1`` steps (the prefill gives the first), and its time per output token is at least
``S + (report + join * S) / (n - 1)``: the report of its first token to the scheduler and
the wait to join a step come before its first step on the decode worker. Short answers
cannot keep a 50 ms SLO on slow steps, whatever their worker.

Two bounds, each with no wait to join a step (``join`` 0: a strict bound) and with half a
step (``join`` 0.5: what a handoff landing at a random time waits on average):

- **one step time**: every decode worker steps alike. The best ``S`` of
  ``served(S) * good_share(S)``, where ``served(S)`` is the workers' tokens a second over the
  trace's mean steps a request, and ``good_share(S)`` the requests whose answer keeps the
  TPOT SLO at ``S``.
- **two step times**: ``k`` workers step in ``S1``, the rest in ``S2 >= S1``, and answers
  are placed by their length (those that keep the SLO at ``S2`` there, those that keep it
  only at ``S1`` on the quick ones, the rest anywhere). A placement that knows each answer's
  length (the simulator's ``max_tokens`` is the trace's exact output length), and any
  mixture of step times over time, is no better than this.

Both take every request as admitted at random (a policy that refused requests for their
answer length would serve more requests, by serving less work), every step exactly its
time, and nothing else as a limit: no KV transfer time, no KV capacity, no prefill
capacity, no TTFT SLO. Each of these only lowers what a real fleet serves, so the figures
are upper bounds of the cost model's fleet: the simulator's runs (``bench sim``) stay
under them.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from switchyard.bench.costmodel import CostModel
from switchyard.bench.sim import positive_int
from switchyard.bench.traces import TraceRequest, read_trace

_Floats = npt.NDArray[np.floating[Any]]
_JOINS = (0.0, 0.5)  # the wait to join a step, in steps: none (strict), half (on average)
_STEP_GRID_S = 0.0001  # step times tried, every 0.1 ms


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Mooncake JSONL or Azure CSV trace")
    p.add_argument("--format", choices=("mooncake", "azure"), default=None, help="default: from the file")
    p.add_argument("--decode", type=positive_int, default=2, help="decode workers (default 2)")
    p.add_argument("--tpot-slo-s", type=float, default=0.05, help="time per output token at most this")
    p.add_argument(
        "--report-delay-s",
        type=float,
        default=0.01,
        help="the first token's report reaches the scheduler this late (bench sim's default, 0.01)",
    )
    p.add_argument(
        "--peer-goodput",
        type=float,
        default=None,
        help="the best peer's peak goodput, req/s (bench matrix): print each bound's ratio to it",
    )
    p.add_argument("--out", type=Path, default=Path("bench/results/bound"), help="bound.json and bound.png here")


@dataclass(frozen=True, slots=True)
class Bound:
    model: str  # "one step time" or "two step times"
    join_steps: float
    goodput_rps: float
    served_rps: float
    good_share: float
    step_s: float  # the slower workers' step time
    quick_step_s: float  # the quicker workers' (the same for one step time)
    quick_workers: int  # workers stepping at quick_step_s (0 for one step time)
    sequences: float  # a slow worker's sequences


class Answers:
    """The trace's answers as the bound needs them: sorted by decode steps (``n - 1``), with
    running sums, so that the requests keeping the SLO at a step time are a suffix."""

    def __init__(self, requests: list[TraceRequest], cost: CostModel) -> None:
        if not requests:
            raise ValueError("the trace has no requests")
        outputs = np.array([r.output_tokens for r in requests], dtype=np.int64)
        steps = np.maximum(outputs - 1, 0)
        order = np.argsort(steps, kind="stable")
        self.count = len(requests)
        self.steps = steps[order]
        self.step_sums = np.concatenate(([0], np.cumsum(self.steps)))  # steps of the first i answers
        self.mean_steps = float(self.steps.mean())
        self.one_token = int(np.searchsorted(self.steps, 1, side="left"))  # answers of no step: first, always kept
        decoded = int(self.step_sums[-1])
        # The KV a sequence holds at a step, averaged over every step of every answer.
        self.context = (
            sum(max(r.output_tokens - 1, 0) * (r.input_tokens + r.output_tokens / 2) for r in requests) / decoded
            if decoded
            else 0.0
        )
        self.per_seq_s = cost.decode_per_seq_s + cost.decode_per_kv_token_s * self.context
        self.base_s = cost.decode_base_s

    def sequences(self, step_s: _Floats) -> _Floats:
        return np.maximum(step_s - self.base_s, 0.0) / self.per_seq_s

    def first_good(self, step_s: _Floats, slo_s: float, report_s: float, join: float) -> npt.NDArray[np.int64]:
        """By step time, the index (in ``steps`` order) of the first answer of one step or
        more that keeps the SLO (``count`` where none does). An answer of ``k`` steps keeps
        it when ``k * (slo - S) >= report + join * S``."""
        slack = slo_s - step_s
        positive = slack > 0
        need = np.where(positive, (report_s + join * step_s) / np.where(positive, slack, 1.0), math.inf)
        least = np.maximum(np.ceil(need - 1e-9), 1.0)  # steps an answer needs, at least one
        first = np.searchsorted(self.steps, np.where(positive, least, 0.0), side="left")
        return np.where(positive, first, self.count).astype(np.int64)


@dataclass(frozen=True)
class _Curves:
    """Over the step times tried (every ``_STEP_GRID_S`` up to the SLO), with every worker
    stepping alike: one worker's tokens a second, the requests served a second, and by
    join wait (``_JOINS``) the first answer kept (``Answers.first_good``) and the share kept."""

    steps: _Floats
    rate: _Floats
    served: _Floats
    first: dict[float, npt.NDArray[np.int64]]
    good: dict[float, _Floats]


def _curves(answers: Answers, workers: int, slo_s: float, report_s: float) -> _Curves:
    steps = np.arange(answers.base_s + _STEP_GRID_S, slo_s, _STEP_GRID_S)
    if not len(steps):
        raise ValueError(
            f"a decode step takes at least {answers.base_s * 1e3:.1f} ms: no step keeps a {slo_s * 1e3:g} ms SLO"
        )
    rate = answers.sequences(steps) / steps
    first = {join: answers.first_good(steps, slo_s, report_s, join) for join in _JOINS}
    good: dict[float, _Floats] = {j: (answers.count - f + answers.one_token) / answers.count for j, f in first.items()}
    return _Curves(steps, rate, workers * rate / max(answers.mean_steps, 1e-12), first, good)


def bounds(answers: Answers, workers: int, slo_s: float, report_s: float) -> list[Bound]:
    """The one- and two-step-time bounds, for each join wait (``_JOINS``)."""
    curves = _curves(answers, workers, slo_s, report_s)
    steps, served = curves.steps, curves.served
    out: list[Bound] = []
    for join in _JOINS:
        good = curves.good[join]
        goodput = served * good
        i = int(np.argmax(goodput))
        one = Bound(
            model="one step time",
            join_steps=join,
            goodput_rps=float(goodput[i]),
            served_rps=float(served[i]),
            good_share=float(good[i]),
            step_s=float(steps[i]),
            quick_step_s=float(steps[i]),
            quick_workers=0,
            sequences=float(answers.sequences(steps[i : i + 1])[0]),
        )
        out += [one, _two_speeds(answers, workers, steps, curves.rate, curves.first[join], one)]
    return out


def _two_speeds(
    answers: Answers,
    workers: int,
    steps: _Floats,
    rate: _Floats,
    first: npt.NDArray[np.int64],
    one: Bound,
) -> Bound:
    """``k`` workers at ``S1``, the rest at ``S2 >= S1``; answers by length. Per admitted
    request: the steps of answers good only at ``S1`` (``first[S1]`` up to ``first[S2]``),
    which only the quick workers may take, and the steps of all. Serving ``R`` requests a
    second needs ``R * quick <= T1`` and ``R * all <= T1 + T2``; goodput ``R * good``. With
    one worker, or where no split beats it, the one-step-time bound (``quick_workers`` 0)."""
    sums, n, zero = answers.step_sums, answers.count, answers.one_token
    best = replace(one, model="two step times")
    for k in range(1, workers):
        for a in range(len(steps)):
            b = np.arange(a, len(steps))
            f1, f2 = first[a], first[b]
            quick = (sums[np.maximum(f2, f1)] - sums[f1]) / n
            good = (n - np.minimum(f1, f2) + zero) / n
            served = (k * rate[a] + (workers - k) * rate[b]) / max(answers.mean_steps, 1e-12)
            held = np.where(quick > 0, k * rate[a] / np.where(quick > 0, quick, 1.0), math.inf)
            served = np.minimum(served, held)
            goodput = served * good
            j = int(np.argmax(goodput))
            if goodput[j] > best.goodput_rps:
                best = Bound(
                    model="two step times",
                    join_steps=one.join_steps,
                    goodput_rps=float(goodput[j]),
                    served_rps=float(served[j]),
                    good_share=float(good[j]),
                    step_s=float(steps[b[j]]),
                    quick_step_s=float(steps[a]),
                    quick_workers=k,
                    sequences=float(answers.sequences(steps[b[j] : b[j] + 1])[0]),
                )
    return best


def run(args: argparse.Namespace) -> int:
    if not 0 < args.tpot_slo_s < math.inf or not 0 <= args.report_delay_s < math.inf:
        raise SystemExit("--tpot-slo-s must be positive and --report-delay-s not negative")
    if args.peer_goodput is not None and not 0 < args.peer_goodput < math.inf:
        raise SystemExit("--peer-goodput must be a positive number of requests a second")
    requests = read_trace(args.trace, args.format)
    cost = CostModel()
    answers = Answers(requests, cost)
    found = bounds(answers, args.decode, args.tpot_slo_s, args.report_delay_s)
    print(
        f"{args.trace.name}: {answers.count} requests, {answers.mean_steps:.1f} decode steps a request, "
        f"{answers.context:,.0f} KV tokens a decoding sequence ({answers.per_seq_s * 1e3:.3f} ms of each step); "
        f"{args.decode} decode workers, TPOT SLO {args.tpot_slo_s * 1e3:g} ms, report {args.report_delay_s * 1e3:g} ms"
    )
    print(table(found, args.peer_goodput))
    args.out.mkdir(parents=True, exist_ok=True)
    record = {
        "trace": args.trace.name,
        "requests": answers.count,
        "decode_workers": args.decode,
        "tpot_slo_s": args.tpot_slo_s,
        "report_delay_s": args.report_delay_s,
        "mean_decode_steps": answers.mean_steps,
        "context_tokens": answers.context,
        "per_sequence_s": answers.per_seq_s,
        "peer_goodput_rps": args.peer_goodput,
        "bounds": [asdict(b) for b in found],
    }
    (args.out / "bound.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(
        _curves(answers, args.decode, args.tpot_slo_s, args.report_delay_s),
        args.decode,
        args.peer_goodput,
        args.out / "bound.png",
    )
    print(f"\nwrote {args.out / 'bound.json'}, {args.out / 'bound.png'}")
    return 0


def table(found: list[Bound], peer: float | None) -> str:
    head = "model            join  goodput  ratio  served  good%  step ms  quick ms  quick  seqs/worker"
    lines = [head]
    for b in found:
        ratio = f"{b.goodput_rps / peer:5.2f}" if peer else "    -"
        lines.append(
            f"{b.model:<16} {b.join_steps:4.1f} {b.goodput_rps:8.2f} {ratio}  {b.served_rps:6.2f} {b.good_share:6.1%} "
            f"{b.step_s * 1e3:8.1f} {b.quick_step_s * 1e3:9.1f} {b.quick_workers:6d} {b.sequences:12.1f}"
        )
    return "\n".join(lines)


def plot(curves: _Curves, workers: int, peer: float | None, path: Path) -> None:
    """Goodput against the step time, one step time for every worker, each join wait."""
    from switchyard.bench import plots

    steps_ms = curves.steps * 1e3
    fig, ax = plots.figure()
    ax.plot(steps_ms, curves.served, ":", label="served (every request admitted at random)")
    for join, good in curves.good.items():
        ax.plot(steps_ms, curves.served * good, label=f"goodput, join wait {join:g} step")
    if peer:
        ax.axhline(peer, color="grey", linestyle="--", label="best peer's peak")
        ax.axhline(1.3 * peer, color="black", linestyle="--", label="1.3x the best peer")
    plots.save(
        fig, ax, path, title=f"what {workers} decode workers can serve", xlabel="decode step, ms", ylabel="requests/s"
    )


__all__ = ["Answers", "Bound", "bounds"]
