"""Checking the cost model against the measurement it was calibrated to.

NVIDIA's table (``bench.costmodel``) comes from a closed loop: ``concurrency`` clients,
each sending its next request (fixed input and output lengths) when the last one ends,
to one colocated model instance. ``closed_loop`` replays that loop through a simulated
``both`` worker (no scheduler: one worker has nothing to place) and returns the mean
TTFT and ITL, so the model can be read side by side with the published rows.
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.bench.costmodel import CostModel
from switchyard.bench.fleet import EventLoop, SimWorker
from switchyard.schemas import (
    KvEventBatch,
    LocalTask,
    PrefillDone,
    RequestFinished,
    RequestSpec,
    SamplingParams,
    WorkerEvent,
)


@dataclass(frozen=True)
class Row:
    input_tokens: int
    output_tokens: int
    concurrency: int
    ttft_ms: float
    itl_ms: float


# NVIDIA NIM 1.8.0, Llama-3.3-70B-Instruct, 2 x H100 80G, FP8, TP2 (see bench.costmodel).
PUBLISHED = (
    Row(5000, 500, 1, 406.77, 18.58),
    Row(5000, 500, 5, 546.70, 21.83),
    Row(5000, 500, 25, 688.69, 38.75),
    Row(5000, 500, 50, 834.51, 59.73),
    Row(500, 2000, 1, 47.77, 18.91),
)


class _ClosedLoop:
    def __init__(self, cost: CostModel, row: Row, requests: int) -> None:
        self.row, self.requests = row, requests
        self.loop = EventLoop()
        self.worker = SimWorker("instance", "both", cost, 0, self.loop, self)
        self.sent: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.ttft: list[float] = []
        self.itl: list[float] = []

    def run(self) -> Row:
        for _ in range(self.row.concurrency):
            self.loop.at(0.0, self.send)
        self.loop.run()
        skip = self.row.concurrency  # the first wave starts in lockstep: not steady state
        ttft, itl = self.ttft[skip:] or self.ttft, self.itl[skip:] or self.itl
        return Row(
            self.row.input_tokens,
            self.row.output_tokens,
            self.row.concurrency,
            1e3 * sum(ttft) / len(ttft),
            1e3 * sum(itl) / len(itl),
        )

    def send(self, now: float) -> None:
        if len(self.sent) >= self.requests:
            return
        rid = str(len(self.sent))
        self.sent[rid] = now
        spec = RequestSpec(
            request_id=rid,
            ingress_id="calibration",
            model="m",
            prompt_tokens=[0] * self.row.input_tokens,
            block_size=512,
            block_keys=[],
            sampling=SamplingParams(max_tokens=self.row.output_tokens),
        )
        self.worker.accept(LocalTask(spec=spec, queued_s=0.0), now)

    def worker_event(self, event: WorkerEvent, now: float) -> None:
        match event:
            case PrefillDone(request_id=rid):
                self.first[rid] = now
                self.ttft.append(now - self.sent[rid])
            case RequestFinished(request_id=rid):
                self.itl.append((now - self.first[rid]) / (self.row.output_tokens - 1))
                self.send(now)

    def kv_events(self, batch: KvEventBatch, now: float) -> None:
        pass


def closed_loop(cost: CostModel, row: Row, requests: int | None = None) -> Row:
    """The model's mean TTFT and ITL for ``row``'s lengths and concurrency."""
    return _ClosedLoop(cost, row, requests or max(4 * row.concurrency, 8)).run()


def compare(cost: CostModel = CostModel()) -> list[tuple[Row, Row]]:
    """(published, model) for every published row."""
    return [(row, closed_loop(cost, row)) for row in PUBLISHED]


if __name__ == "__main__":
    print(f"{'in/out':>10}{'conc':>6}{'TTFT pub':>10}{'model':>8}{'ITL pub':>9}{'model':>8}")
    for pub, model in compare():
        print(
            f"{pub.input_tokens:>5}/{pub.output_tokens:<4}{pub.concurrency:>6}{pub.ttft_ms:>10.1f}"
            f"{model.ttft_ms:>8.1f}{pub.itl_ms:>9.2f}{model.itl_ms:>8.2f}"
        )
