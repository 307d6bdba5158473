"""Build a worker from its config: the engine its config names, in the role it names."""

from __future__ import annotations

from workers.config import WorkerConfig
from workers.decode import DecodeRole
from workers.prefill import PrefillRole
from workers.runtime import WorkerRuntime
from workers.sim import SimEngine


def build_worker(config: WorkerConfig) -> WorkerRuntime:
    config = config.with_id()
    engine = SimEngine(config.sim, config.worker_id)  # the only engine so far
    role_cls = PrefillRole if config.role == "prefill" else DecodeRole
    return WorkerRuntime(config, role_cls(engine, config.worker_id, config.token_budget))
