"""The real stack for tests: a real nats-server, real services on real sockets.

Services run in one background event loop (an anyio blocking portal), so tests are
plain synchronous code using the official ``openai`` client over real HTTP. Each
service object stays reachable, so a test can look at a worker's own in-flight count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import httpx
import msgspec
from anyio.from_thread import BlockingPortal, start_blocking_portal

from switchyard.cli import BUNDLED_MODEL
from switchyard.ingress.config import IngressConfig
from switchyard.ingress.service import IngressService
from switchyard.scheduler.config import SchedulerConfig
from switchyard.scheduler.service import SchedulerService, SchedulerServiceConfig
from switchyard.workers import WorkerConfig, build_worker
from switchyard.workers.runtime import WorkerRuntime
from switchyard.workers.sim import SimCostModel, SimEngineConfig

MODEL = "switchyard-sim"
SIM = SimEngineConfig(
    token_low=256, token_high=4093, eos_token_id=4095, tokenizer_path=str(Path(BUNDLED_MODEL) / "tokenizer.json")
)


def worker_config(nats_url: str, role: str, cost: SimCostModel = SimCostModel(), **overrides) -> WorkerConfig:
    sim = msgspec.structs.replace(overrides.pop("sim", SIM), cost=cost)
    settings = {"report_interval_s": 0.1, **overrides}
    return WorkerConfig(nats_url=nats_url, role=role, model=MODEL, sim=sim, **settings)


@dataclass
class Stack:
    nats_url: str
    portal: BlockingPortal
    scheduler: SchedulerService
    ingress: IngressService
    workers: list[WorkerRuntime] = field(default_factory=list)
    _futures: list = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return self.ingress.url + "/v1"

    def workers_of(self, role: str) -> list[WorkerRuntime]:
        return [w for w in self.workers if w.config.role == role]

    def start(self, run) -> object:
        future, value = self.portal.start_task(run)
        self._futures.append(future)
        return value

    def add_worker(self, config: WorkerConfig) -> WorkerRuntime:
        worker = build_worker(config)
        self.start(worker.run)
        self.workers.append(worker)
        return worker

    def wait_healthy(self, prefill: int = 1, decode: int = 1, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        body: dict = {}
        while time.monotonic() < deadline:
            body = httpx.get(self.ingress.url + "/health", timeout=2).json()
            if body.get("prefill_workers", 0) >= prefill and body.get("decode_workers", 0) >= decode:
                return body
            time.sleep(0.05)
        raise AssertionError(f"stack not healthy within {timeout_s} s: {body}")

    def stop_scheduler(self) -> None:
        """Stop the scheduler (the first task started), as if it died; ``start`` a new one."""
        future = self._futures.pop(0)
        future.cancel()
        try:
            future.result(timeout=10)
        except BaseException:  # cancelled is the expected ending
            pass

    def stop(self) -> None:
        for future in reversed(self._futures):
            future.cancel()
        for future in reversed(self._futures):
            try:
                future.result(timeout=10)
            except BaseException:  # cancelled is the expected ending
                pass


@contextmanager
def running_stack(
    nats_url: str,
    *,
    prefill: int = 1,
    decode: int = 1,
    scheduler: SchedulerConfig = SchedulerConfig(worker_expiry_s=1.0),
    prefill_cost: SimCostModel = SimCostModel(),
    decode_cost: SimCostModel = SimCostModel(),
    worker_overrides: dict | None = None,
    ingress_overrides: dict | None = None,
    scheduler_overrides: dict | None = None,
) -> Iterator[Stack]:
    overrides = worker_overrides or {}
    with start_blocking_portal(backend="asyncio") as portal:
        sched = SchedulerService(
            SchedulerServiceConfig(nats_url=nats_url, core=scheduler, **(scheduler_overrides or {}))
        )
        ingress = IngressService(
            IngressConfig(nats_url=nats_url, model_dir=str(BUNDLED_MODEL), port=0, **(ingress_overrides or {}))
        )
        stack = Stack(nats_url=nats_url, portal=portal, scheduler=sched, ingress=ingress)
        try:
            stack.start(sched.run)
            for _ in range(prefill):
                stack.add_worker(worker_config(nats_url, "prefill", prefill_cost, **overrides))
            for _ in range(decode):
                stack.add_worker(worker_config(nats_url, "decode", decode_cost, **overrides))
            stack.start(ingress.run)
            stack.wait_healthy(prefill, decode)
            yield stack
        finally:
            stack.stop()


def wait_until(predicate, timeout_s: float = 5.0, interval_s: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


__all__ = ["MODEL", "Path", "Stack", "anyio", "running_stack", "wait_until", "worker_config"]
