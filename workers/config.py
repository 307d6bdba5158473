"""Worker configuration: one frozen tree per worker, built at the edge (``switchyard.settings``)."""

from __future__ import annotations

import uuid
from typing import Annotated, Literal

import msgspec

from switchyard.observability import DEFAULT_NATS_URL, NatsClient, NatsClientConfig, NatsUrl
from switchyard.schemas import DEVICE_CLASS_MAX, ConfigStruct, Role, setting
from switchyard.workers.sim import SimEngineConfig
from switchyard.workers.vllm_config import VllmEngineConfig


class WorkerConfig(ConfigStruct, frozen=True, kw_only=True):
    nats_url: NatsUrl = DEFAULT_NATS_URL
    nats_client: NatsClient = NatsClientConfig()
    role: Annotated[Role, setting("prefill, decode, or both (colocated: it prefills and decodes)")]
    # The model's name on the bus; the CLI fills in the tokenizer's when none is given.
    model: Annotated[
        str, setting("the model's name on the bus (default: its directory's)", flag="served-model-name")
    ] = ""
    engine: Annotated[Literal["sim", "vllm"], setting("the engine: sim (a cost model) or vllm")] = "sim"
    model_path: Annotated[str, setting("model directory", flag="model")] = ""
    worker_id: Annotated[str, setting("this worker's id on the bus (default: generated)")] = ""
    block_size: Annotated[int, setting("the engine's KV block size; default: 16 (sim), 32 (vllm)", gt=0)] = 16
    token_budget: Annotated[
        int,
        setting(
            "prefill: prompt tokens accepted in flight; decode and both: KV tokens held (prompt + max_tokens)", gt=0
        ),
    ] = 65_536
    report_interval_s: Annotated[float, setting("seconds between heartbeats (load reports)", gt=0)] = 0.5
    device_class: Annotated[
        str,
        setting(
            "the kind of hardware it runs on (say H100x2): workers that name one class share one prefill "
            "rate; in a fleet of unlike GPUs, name each kind",
            max_length=DEVICE_CLASS_MAX,
        ),
    ] = ""
    # See workers/decode.py.
    min_publish_interval_s: Annotated[float, setting("decode: steps faster than this share one bus message", ge=0)] = (
        0.001
    )
    sim: Annotated[SimEngineConfig, setting("the sim engine", prefix="sim-")] = SimEngineConfig()
    vllm: Annotated[VllmEngineConfig, setting("the vllm engine", prefix="")] = VllmEngineConfig()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, got {self.role!r}")
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
