"""Prefill and decode workers around an engine: ``sim`` (a cost model) or ``vllm`` (the real one)."""

if __name__ != "switchyard.workers":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.workers, not {__name__}")

from typing import TYPE_CHECKING

from switchyard.schemas import lazy_attributes
from switchyard.workers.config import WorkerConfig
from switchyard.workers.sim import SimCostModel, SimEngineConfig, TierCache
from switchyard.workers.vllm_config import (
    KvTransfer,
    LmcacheSettings,
    MooncakeSettings,
    ParallelSettings,
    SpeculativeSettings,
    VllmEngineConfig,
)

if TYPE_CHECKING:
    from switchyard.workers.factory import build_worker
    from switchyard.workers.vllm_engine import VllmEngine

_LAZY = {"build_worker": "switchyard.workers.factory", "VllmEngine": "switchyard.workers.vllm_engine"}

__all__ = [
    "KvTransfer",
    "LmcacheSettings",
    "MooncakeSettings",
    "ParallelSettings",
    "SimCostModel",
    "SimEngineConfig",
    "SpeculativeSettings",
    "TierCache",
    "VllmEngine",
    "VllmEngineConfig",
    "WorkerConfig",
    "build_worker",
]


__getattr__ = lazy_attributes(__name__, _LAZY)
