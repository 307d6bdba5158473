"""Prefill and decode workers around an engine (``sim`` now; ``vllm`` next)."""

if __name__ != "switchyard.workers":  # one module, one name: the wheel installs only `switchyard`
    raise ImportError(f"import switchyard.workers, not {__name__}")

from switchyard.workers.config import WorkerConfig
from switchyard.workers.factory import build_worker

__all__ = ["WorkerConfig", "build_worker"]
