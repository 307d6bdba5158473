"""``switchyard bench synth``: seeded Mooncake-format traces of shapes we have no real
trace of, to check that placement holds beyond the two traces in ``shared/data``.

    switchyard bench synth --shape toolagent --out /tmp/toolagent.jsonl
    switchyard bench matrix --mooncake /tmp/toolagent.jsonl --cases mooncake-6p2d-device --out /tmp/m

Issue 13's figures are checked on traces we do not have, so a policy that wins only on the
Mooncake conversation trace is not enough. These are not fitted to anything and claim no
fidelity to a real workload; each is a different stress, described by its ``Shape``:

- ``toolagent``: agent episodes. A few long tool prompts (system + tool schemas, 4-16
  blocks) shared by most episodes, each episode a chain of steps seconds apart that append
  a tool result (1-4 blocks) to the previous step's prompt, the first one a task of its own
  (1-8 blocks); short outputs (median ~60
  tokens). Reuse is high and lies both across sessions (the tool prompts) and within one.
- ``longdoc``: documents of 16-56 blocks, each asked about by several users over minutes
  (a shared long prefix, then 1 block of question); few turns, outputs ~150 tokens.
- ``bursty``: conversations like the Mooncake trace's (a popular system prompt, turns
  extending their prefix), arriving in on/off bursts: 2.5x the mean rate for a third of the
  time, the rest at 0.25x (a two-state modulated Poisson process).

The file is Mooncake JSONL (``timestamp`` in ms, ``input_length``, ``output_length``,
``hash_ids``: one per 512 tokens, prefix-chained), so ``bench sim``, ``bench matrix
--mooncake`` and anything else that reads that format takes it unchanged. The same shape,
seed and flags give the same file byte for byte.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from switchyard.bench.traces import TRACE_BLOCK_SIZE


@dataclass(frozen=True)
class Shape:
    """One workload: how sessions start and what each of their requests looks like."""

    rate_rps: float  # mean requests a second over the trace
    prefixes: int  # shared prefixes (tool prompts, documents, system prompts)
    prefix_blocks: tuple[int, int]  # their length in blocks, inclusive
    zipf: float  # popularity of the shared prefixes (rank ** -zipf)
    steps: tuple[int, int]  # requests per session, inclusive
    step_gap_s: float  # mean seconds between a session's requests (exponential)
    new_blocks: tuple[int, int]  # blocks a request adds to its session's prompt, inclusive
    output_median: int  # output tokens: lognormal with this median
    output_sigma: float
    first_blocks: tuple[int, int] | None = None  # a session's first request adds these instead
    reset_prefix: bool = False  # each request is shared prefix + new blocks only (no chain)
    bursts: bool = False  # arrivals on/off modulated (see the module note)


SHAPES = {
    "toolagent": Shape(
        rate_rps=6.0,
        prefixes=24,
        prefix_blocks=(4, 16),
        zipf=1.1,
        steps=(2, 12),
        step_gap_s=4.0,
        new_blocks=(1, 4),
        first_blocks=(1, 8),
        output_median=60,
        output_sigma=1.2,
    ),
    "longdoc": Shape(
        rate_rps=2.5,
        prefixes=400,
        prefix_blocks=(16, 56),
        zipf=0.8,
        steps=(1, 3),
        step_gap_s=60.0,
        new_blocks=(1, 1),
        output_median=150,
        output_sigma=0.6,
        reset_prefix=True,
    ),
    "bursty": Shape(
        rate_rps=3.4,
        prefixes=32,
        prefix_blocks=(1, 6),
        zipf=1.0,
        steps=(1, 8),
        step_gap_s=40.0,
        new_blocks=(2, 16),
        output_median=300,
        output_sigma=0.5,
        bursts=True,
    ),
}
MAX_BLOCKS = 64  # 32k tokens: the longest prompt a session may grow to
_BURST_HIGH, _BURST_LOW, _BURST_SHARE, _BURST_MEAN_S = 2.5, 0.25, 1 / 3, 60.0


@dataclass(frozen=True)
class Row:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]

    def json(self) -> str:
        return json.dumps(
            {
                "timestamp": round(self.arrival_s * 1000),
                "input_length": self.input_tokens,
                "output_length": self.output_tokens,
                "hash_ids": list(self.hash_ids),
            }
        )


def generate(shape: Shape, duration_s: float, seed: int) -> list[Row]:
    """The trace's requests in arrival order, for ``duration_s`` seconds of arrivals."""
    rng = random.Random(seed)
    ids = _Ids()
    prefixes = [ids.take(rng.randint(*shape.prefix_blocks)) for _ in range(shape.prefixes)]
    weights = [(rank + 1) ** -shape.zipf for rank in range(shape.prefixes)]
    mean_steps = (shape.steps[0] + shape.steps[1]) / 2
    rows: list[Row] = []
    pending: list[tuple[float, int, _Session]] = []  # (time of its next request, tiebreak, session)
    serial = 0
    for start in _session_starts(shape, shape.rate_rps / mean_steps, duration_s, rng):
        while pending and pending[0][0] <= start:
            _step(heapq.heappop(pending), shape, rng, ids, rows, pending)
        base = rng.choices(prefixes, weights)[0]
        session = _Session(base=base, prompt=base, left=rng.randint(*shape.steps))
        serial += 1
        _step((start, serial, session), shape, rng, ids, rows, pending)
    while pending and pending[0][0] <= duration_s:
        _step(heapq.heappop(pending), shape, rng, ids, rows, pending)
    rows.sort(key=lambda r: r.arrival_s)
    return rows


@dataclass
class _Session:
    base: tuple[int, ...]
    prompt: tuple[int, ...]
    left: int


class _Ids:
    """Fresh block ids, never reused: equal ids mean the same prefix block."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        first, self.next = self.next, self.next + n
        return tuple(range(first, first + n))


def _step(item, shape: Shape, rng: random.Random, ids: _Ids, rows: list[Row], pending: list) -> None:
    at, serial, session = item
    head = session.base if shape.reset_prefix else session.prompt
    first = session.prompt is session.base and shape.first_blocks is not None
    adds = shape.first_blocks if first and shape.first_blocks else shape.new_blocks
    prompt = (head + ids.take(rng.randint(*adds)))[:MAX_BLOCKS]
    tokens = len(prompt) * TRACE_BLOCK_SIZE - rng.randrange(TRACE_BLOCK_SIZE)  # the last block partial
    output = max(1, round(shape.output_median * math.exp(rng.gauss(0.0, shape.output_sigma))))
    rows.append(Row(at, tokens, min(output, 4096), prompt))
    session.prompt, session.left = prompt, session.left - 1
    if session.left > 0 and len(prompt) < MAX_BLOCKS:
        heapq.heappush(pending, (at + rng.expovariate(1.0 / shape.step_gap_s), serial, session))


def _session_starts(shape: Shape, rate: float, duration_s: float, rng: random.Random) -> Iterator[float]:
    """Poisson session starts at ``rate``/s, or its on/off modulation with the same mean."""
    t, high, switch = 0.0, False, 0.0
    while True:
        if shape.bursts and t >= switch:
            high = not high
            share = _BURST_SHARE if high else 1 - _BURST_SHARE
            switch = t + rng.expovariate(1.0 / (_BURST_MEAN_S * share / _BURST_SHARE))
        # High and low rates chosen so that the time-weighted mean is `rate`.
        scale = (_BURST_HIGH if high else _BURST_LOW) / _burst_mean() if shape.bursts else 1.0
        t += rng.expovariate(rate * scale)
        if t > duration_s:
            return
        yield t


def _burst_mean() -> float:
    return _BURST_HIGH * _BURST_SHARE + _BURST_LOW * (1 - _BURST_SHARE)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=sorted(SHAPES), required=True, help="the workload (see bench/synth.py)")
    p.add_argument("--out", type=Path, required=True, help="the JSONL file to write")
    p.add_argument("--duration-s", type=float, default=3600.0, help="seconds of arrivals (default 3600)")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    if not args.duration_s > 0:
        raise SystemExit("--duration-s must be positive")
    rows = generate(SHAPES[args.shape], args.duration_s, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(row.json() + "\n" for row in rows))
    inputs = sorted(r.input_tokens for r in rows)
    outputs = sorted(r.output_tokens for r in rows)
    print(
        f"wrote {args.out}: {len(rows)} requests over {args.duration_s:g} s ({len(rows) / args.duration_s:.2f} req/s); "
        f"input mean {sum(inputs) / len(inputs):,.0f} / p50 {inputs[len(inputs) // 2]:,} tokens, "
        f"output mean {sum(outputs) / len(outputs):,.0f} / p50 {outputs[len(outputs) // 2]:,}"
    )
    return 0
