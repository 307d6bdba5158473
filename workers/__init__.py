"""Prefill and decode workers around an engine: ``sim`` (a cost model) or ``vllm`` (the real one)."""

if __name__ != "switchyard.workers":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.workers, not {__name__}")

from typing import TYPE_CHECKING, Any

from switchyard.workers.config import WorkerConfig
from switchyard.workers.sim import SimCostModel, SimEngineConfig
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
    "VllmEngine",
    "VllmEngineConfig",
    "WorkerConfig",
    "build_worker",
]


def __getattr__(name: str) -> Any:
    """The heavy parts (the worker runtime and the vLLM engine) load on first use, so that importing the
    light ones (configs, in every process's CLI) pulls no web server, engine or bus client."""
    if name in _LAZY:
        from importlib import import_module

        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
