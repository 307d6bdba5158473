"""Build a worker from its config: the engine its config names, in the role it names."""

from __future__ import annotations

from switchyard.workers.config import WorkerConfig
from switchyard.workers.decode import DecodeRole
from switchyard.workers.engine import DecodeEngine
from switchyard.workers.prefill import PrefillRole
from switchyard.workers.runtime import Role, WorkerRuntime
from switchyard.workers.sim import SimEngine


def build_worker(config: WorkerConfig) -> WorkerRuntime:
    config = config.with_id()
    engine: DecodeEngine  # either engine plays both roles
    if config.engine == "vllm":
        from switchyard.workers.vllm_engine import VllmEngine  # imports vLLM only when asked for

        engine = VllmEngine(config.vllm, config.model_path, config.role, config.worker_id)
    else:
        engine = SimEngine(config.sim, config.worker_id)
    role: Role
    if config.role == "prefill":
        role = PrefillRole(engine, config.worker_id, config.token_budget)
    else:  # decode, or both (colocated: it prefills too)
        role = DecodeRole(
            engine,
            config.worker_id,
            config.token_budget,
            config.min_publish_interval_s,
            prefills=config.role == "both",
        )
    return WorkerRuntime(config, role)
