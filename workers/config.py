"""Worker configuration: one frozen tree per worker, built at the edge."""

from __future__ import annotations

import uuid
from typing import Literal

import msgspec

from switchyard.schemas import Role
from switchyard.workers.sim import SimEngineConfig
from switchyard.workers.vllm_config import VllmEngineConfig


class WorkerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str
    role: Role
    model: str
    engine: Literal["sim", "vllm"] = "sim"
    model_path: str = ""  # vllm: the model directory (or name) the engine loads
    worker_id: str = ""
    block_size: int = 16
    # prefill: prompt tokens accepted in flight; decode: KV tokens held (prompt + max_tokens)
    token_budget: int = 65_536
    report_interval_s: float = 0.5
    # decode: steps faster than this share one bus message (see workers/decode.py)
    min_publish_interval_s: float = 0.001
    sim: SimEngineConfig = SimEngineConfig()
    vllm: VllmEngineConfig = VllmEngineConfig()

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.token_budget <= 0 or self.block_size <= 0 or self.report_interval_s <= 0:
            raise ValueError("token_budget, block_size and report_interval_s must be positive")
        if self.min_publish_interval_s < 0:
            raise ValueError("min_publish_interval_s must not be negative")
        if self.engine == "vllm":
            if not self.model_path:
                raise ValueError("the vllm engine needs model_path")
            if self.block_size != self.vllm.block_size:
                raise ValueError(f"block_size {self.block_size} differs from the vllm engine's {self.vllm.block_size}")

    def with_id(self) -> WorkerConfig:
        """This config with a worker id, generated when none was given."""
        if self.worker_id:
            return self
        return msgspec.structs.replace(self, worker_id=f"{self.role}-{uuid.uuid4().hex[:8]}")
